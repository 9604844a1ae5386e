"""Micro-batches for the policy: variable-length samples packed into token-budgeted rows.

A :class:`PolicySample` is a prompt and a response (token ids), the response's loss mask, old log-probs and advantage.
The model sees ``tokens = prompt ‖ response``; the log-prob of response token ``j`` comes from the logits at position
``P − 1 + j`` (the position before it), so every micro-batch carries, besides the model inputs, a
``response_index [n, R]`` into its flattened positions and the per-response-token tensors the loss needs, all
``[n, R]`` with ``R`` the longest response in it (``response_valid`` marks the real entries; :func:`response_tensors`
builds them for every packer).

How samples become rows is a :class:`~dapo_megatron.backend.interfaces.RowPacker`, the interface the backend defines
and supplies (:mod:`dapo_megatron.backend`): it groups sample indices into micro-batches (``bins``) and lays one
micro-batch out as model inputs (``row``; with no samples, the filler micro-batch a DP rank runs when it has fewer
than the others).
:class:`ThdPacker` is the layout of attention that reads sequence boundaries from ``cu_seqlens`` (Transformer
Engine's fused attention, and the SDPA attention of :mod:`dapo_megatron.policy.sdpa_attention`): first-fit
decreasing puts samples into micro-batches of at most ``token_budget`` tokens, each micro-batch is ONE row holding its
samples back to back, each attending only to itself with positions restarting at 0
(``PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv=…)``; megatron's RoPE restarts at every boundary too).

Rows are padded to a multiple of ``pad_to_multiple`` (the TP size under sequence parallelism, 16 or 32 for FP8); the
padding is a segment of its own that nothing attends to. Packing efficiency = real tokens / processed tokens.

Which samples a DP rank packs, and how many micro-batches every rank runs, is :mod:`dapo_megatron.policy.batch_plan`'s
job. Everything here is deterministic: the same samples in the same order give the same micro-batches on every rank.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

if TYPE_CHECKING:
    from dapo_megatron.backend.interfaces import RowPacker

PAD_TOKEN_ID = 0  # padding positions are never attended to and never in the loss; any valid id works


@dataclass(frozen=True)
class PolicySample:
    """One prompt + response and what the loss needs per response token.

    ``advantage`` is one number for the whole response or ``[R]`` per token; ``old_logprobs`` (``[R]``) may be None
    for forward-only passes; ``loss_mask`` (``[R]``, default all ones) zeroes tokens out of the loss (e.g. an
    overlong-filtered response).
    """

    prompt_ids: Tensor
    response_ids: Tensor
    advantage: float | Tensor = 0.0
    old_logprobs: Tensor | None = None
    loss_mask: Tensor | None = None

    def __post_init__(self) -> None:
        prompt = torch.as_tensor(self.prompt_ids, dtype=torch.long).reshape(-1)
        response = torch.as_tensor(self.response_ids, dtype=torch.long).reshape(-1)
        if prompt.numel() < 1:
            raise ValueError("PolicySample: prompt_ids is empty (the first response token needs a position before it)")
        if response.numel() < 1:
            raise ValueError("PolicySample: response_ids is empty")
        length = response.numel()
        object.__setattr__(self, "prompt_ids", prompt)
        object.__setattr__(self, "response_ids", response)
        for name in ("old_logprobs", "loss_mask"):
            value = getattr(self, name)
            if value is not None:
                value = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
                if value.numel() != length:
                    raise ValueError(f"PolicySample: {name} has {value.numel()} entries for {length} response tokens")
                object.__setattr__(self, name, value)
        advantage = torch.as_tensor(self.advantage, dtype=torch.float32)
        if advantage.dim() > 0 and advantage.numel() != length:
            raise ValueError(f"PolicySample: advantage has {advantage.numel()} entries for {length} response tokens")

    @property
    def prompt_length(self) -> int:
        return self.prompt_ids.numel()

    @property
    def response_length(self) -> int:
        return self.response_ids.numel()

    @property
    def length(self) -> int:
        return self.prompt_length + self.response_length

    @property
    def num_loss_tokens(self) -> int:
        return self.response_length if self.loss_mask is None else int((self.loss_mask != 0).sum())

    def response_tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        """(loss mask, old log-probs, advantages), each float32 ``[R]`` (zeros for missing old log-probs)."""
        length = self.response_length
        mask = torch.ones(length) if self.loss_mask is None else (self.loss_mask != 0).float()
        old = torch.zeros(length) if self.old_logprobs is None else self.old_logprobs
        advantage = torch.as_tensor(self.advantage, dtype=torch.float32).expand(length).clone()
        return mask, old, advantage


@dataclass
class MicroBatch:
    """Model inputs for one micro-batch plus the per-response-token tensors of its ``n`` samples.

    Model inputs ``[B, S]``: ``tokens``, ``position_ids``, ``labels`` (the next token at every position, 0 where
    there is none); ``attention_mask`` ``[B, 1, S, S]`` (True = masked) or None for plain causal attention;
    ``packed_seq_params`` for the THD and segments layouts. Loss inputs ``[n, R]``: ``response_index`` (flat index
    into ``B·S`` of the logits that predict each response token), ``response_valid``, ``loss_mask``,
    ``old_logprobs``, ``advantages``, ``response_ids`` (the tokens predicted). ``sample_indices[i]`` is the position
    of sample ``i`` in the list given to the planner.
    """

    tokens: Tensor
    position_ids: Tensor
    labels: Tensor
    attention_mask: Tensor | None
    packed_seq_params: object | None
    response_index: Tensor
    response_valid: Tensor
    loss_mask: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    response_ids: Tensor
    sample_indices: tuple[int, ...]
    num_real_tokens: int

    @property
    def num_samples(self) -> int:
        return len(self.sample_indices)

    @property
    def num_processed_tokens(self) -> int:
        return self.tokens.numel()

    @property
    def sequence_length(self) -> int:
        return self.tokens.shape[1]

    def to(self, device: torch.device | str) -> "MicroBatch":
        def move(value):
            return value.to(device, non_blocking=True) if isinstance(value, Tensor) else value

        params = self.packed_seq_params
        if params is not None:
            params = replace(params, **{f.name: move(getattr(params, f.name)) for f in fields(params)
                                        if isinstance(getattr(params, f.name), Tensor)})
        return replace(
            self,
            tokens=move(self.tokens), position_ids=move(self.position_ids), labels=move(self.labels),
            attention_mask=move(self.attention_mask), packed_seq_params=params,
            response_index=move(self.response_index), response_valid=move(self.response_valid),
            loss_mask=move(self.loss_mask), old_logprobs=move(self.old_logprobs), advantages=move(self.advantages),
            response_ids=move(self.response_ids),
        )


def packing_efficiency(micro_batches: Sequence[MicroBatch]) -> float:
    """Real tokens / processed tokens (rows × row length, padding and empty micro-batches included)."""
    processed = sum(mb.num_processed_tokens for mb in micro_batches)
    return sum(mb.num_real_tokens for mb in micro_batches) / max(processed, 1)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def first_fit_decreasing(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped into bins of total length ≤ ``token_budget``: longest first, each into the first bin it fits.

    A length above the budget gets a bin of its own (with a warning). Ties keep input order; bins come out in the
    order they were opened. Deterministic for the same input.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for index in order:
        length = lengths[index]
        if length > token_budget:
            warnings.warn(
                f"sample {index} has {length} tokens, more than the micro-batch token budget {token_budget}: "
                f"it gets a micro-batch of its own",
                stacklevel=2,
            )
            bins.append([index])
            room.append(0)
            continue
        for b, free in enumerate(room):
            if length <= free:
                bins[b].append(index)
                room[b] -= length
                break
        else:
            bins.append([index])
            room.append(token_budget - length)
    return bins


def check_vocab(samples: Sequence[PolicySample], indices: Sequence[int], vocab_size: int | None) -> None:
    if vocab_size is None or not indices:
        return
    every = torch.cat([ids for i in indices for ids in (samples[i].prompt_ids, samples[i].response_ids)])
    if int(every.min()) >= 0 and int(every.max()) < vocab_size:
        return
    for index in indices:
        sample = samples[index]
        for name in ("prompt_ids", "response_ids"):
            ids = getattr(sample, name)
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise ValueError(
                    f"sample {index}: {name} has ids outside [0, {vocab_size}) "
                    f"(min {int(ids.min())}, max {int(ids.max())})"
                )


def response_tensors(samples: Sequence[PolicySample], indices: Sequence[int], starts: Sequence[int],
                      predictors: Sequence[int] | None = None):
    """``[n, R]`` response_index/valid/loss_mask/old_logprobs/advantages/response_ids. The logits predicting the
    response tokens are at the flat positions ``predictors`` (all samples' tokens in order) when given, else, for
    sample i, the ``R`` positions from its flat offset ``starts[i]`` plus its prompt length minus one (prompt and
    response back to back). Built with one scatter per tensor, not one per sample: plans of hundreds of samples
    are made every update."""
    picked = [samples[i] for i in indices]
    lengths = torch.tensor([s.response_length for s in picked], dtype=torch.long)
    width = int(lengths.max()) if picked else 0
    valid = torch.arange(width)[None, :] < lengths[:, None]

    def rows(flat: Tensor, dtype: torch.dtype) -> Tensor:
        out = torch.zeros(len(picked), width, dtype=dtype)
        out[valid] = flat.to(dtype)
        return out

    def per_token(values, default: float) -> Tensor:
        if all(v is None for v in values):
            return torch.full((int(lengths.sum()),), default)
        return torch.cat([torch.full((s.response_length,), default) if v is None else v
                          for s, v in zip(picked, values)])

    if not picked:
        empty = torch.zeros(0, 0)
        return empty.long(), empty.bool(), empty, empty, empty, empty.long()
    if predictors is None:
        first = torch.tensor([start + s.prompt_length - 1 for start, s in zip(starts, picked)])
        offset = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
        predictor_index = torch.repeat_interleave(first, lengths) + offset
    else:
        predictor_index = torch.tensor(predictors, dtype=torch.long)
    masks = per_token([None if s.loss_mask is None else (s.loss_mask != 0).float() for s in picked], 1.0)
    old = per_token([s.old_logprobs for s in picked], 0.0)
    if all(isinstance(s.advantage, (int, float)) for s in picked):
        advantages = torch.repeat_interleave(torch.tensor([float(s.advantage) for s in picked]), lengths)
    else:
        advantages = torch.cat([torch.as_tensor(s.advantage, dtype=torch.float32).expand(s.response_length)
                                for s in picked])
    return (rows(predictor_index, torch.long), valid, rows(masks, torch.float32), rows(old, torch.float32),
            rows(advantages, torch.float32), rows(torch.cat([s.response_ids for s in picked]), torch.long))


@dataclass
class ThdRow(PackedSeqParams):
    """megatron's ``PackedSeqParams`` of one THD row, with its segment lengths on the host as well (the SDPA
    attention reads them there; Transformer Engine reads ``cu_seqlens``)."""

    segment_lengths: tuple[int, ...] = ()


class ThdPacker:
    """Samples back to back in one row per micro-batch, sequence boundaries as ``cu_seqlens`` (THD)."""

    def bins(self, samples: Sequence[PolicySample], indices: Sequence[int], token_budget: int) -> list[list[int]]:
        bins = first_fit_decreasing([samples[i].length for i in indices], token_budget)
        return [[indices[j] for j in members] for members in bins]

    def row(self, samples: Sequence[PolicySample], indices: Sequence[int], pad_to_multiple: int) -> MicroBatch:
        tokens, labels, positions, starts, segment_lengths = concatenated_row(samples, indices, pad_to_multiple)
        cu_seqlens = torch.tensor([0] + segment_lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        longest = max(segment_lengths)
        params = ThdRow(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                        max_seqlen_q=longest, max_seqlen_kv=longest, segment_lengths=tuple(segment_lengths))
        return MicroBatch(tokens[None], positions[None], labels[None], None, params,
                          *response_tensors(samples, indices, starts), sample_indices=tuple(indices),
                          num_real_tokens=sum(samples[i].length for i in indices))


def concatenated_row(samples: Sequence[PolicySample], indices: Sequence[int], pad_to_multiple: int):
    """``indices``' samples back to back, padded to a multiple of ``pad_to_multiple``: (tokens ``[S]``, labels
    ``[S]``, positions ``[S]`` restarting at every sample and at the padding, each sample's start, segment lengths)."""
    lengths = [samples[i].length for i in indices]
    real = sum(lengths)
    total = round_up(max(real, 1), pad_to_multiple)
    segment_lengths = lengths + ([total - real] if total > real else [])
    tokens = torch.full((total,), PAD_TOKEN_ID, dtype=torch.long)
    labels = torch.zeros(total, dtype=torch.long)
    positions = torch.cat([torch.arange(length) for length in segment_lengths])
    starts, offset = [], 0
    for index in indices:
        sample = samples[index]
        ids = torch.cat([sample.prompt_ids, sample.response_ids])
        tokens[offset:offset + ids.numel()] = ids
        labels[offset:offset + ids.numel() - 1] = ids[1:]
        starts.append(offset)
        offset += ids.numel()
    return tokens, labels, positions, starts, segment_lengths


def pack_micro_batches(samples: Sequence[PolicySample], packer: RowPacker, *, token_budget: int,
                       pad_to_multiple: int = 1, indices: Sequence[int] | None = None,
                       vocab_size: int | None = None) -> list[MicroBatch]:
    """``samples`` (or the subset ``indices`` of them) as ``packer``'s micro-batches of at most ``token_budget``
    tokens. ``vocab_size``, when given, is checked against every token id (an id in the padded vocabulary rows
    would otherwise give a meaningless log-prob)."""
    indices = list(range(len(samples))) if indices is None else list(indices)
    check_vocab(samples, indices, vocab_size)
    return [packer.row(samples, members, pad_to_multiple) for members in packer.bins(samples, indices, token_budget)]
