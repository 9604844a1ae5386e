"""The rollout batch's way from rank 0, which generates it, to every rank, which trains on it.

:func:`hand_over_rollouts` runs the collection on rank 0 while the other ranks wait in the gloo group of
:mod:`dapo_megatron.rank_zero`, and the batch crosses as packed tensors instead of pickled Python lists (at the
paper's scale 8,192 responses of up to 20k tokens): every per-token and per-response list is flattened into one
tensor with a tensor of lengths, the strings and the step's rollout metrics travel as a small object. Rank 0 trains
on the unpacked copy too, so every rank holds the same batch; packing is exact (:func:`pack_rollout_batch` stores a
value in a narrower dtype only when that loses nothing).

Unpacked, the per-token fields stay tensors: each response's token ids, engine log-probs and token versions are views
into the flat tensors that crossed (ids and versions as int64, log-probs in the dtype they crossed in). Python lists
of ~80M tokens and log-probs on every rank cost ~30 bytes per value more and seconds to build.

The engine's routing (R3, ``RolloutGroup.routed_experts``) does not cross: it stays on rank 0, and every other rank
gets each response's routing as a tensor of its shape on the ``meta`` device (no storage). Each rank later asks rank
0 for the rows it routes, its own share of the step (:mod:`dapo_megatron.policy.rollout_routing`): sent to every
rank, the routing of the paper's batch would be up to 142 GB on every rank's host.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import torch

from dapo_megatron.rank_zero import Packed, run_on_rank0
from dapo_megatron.collectors.group import RolloutGroup

RolloutBatch = tuple[list[RolloutGroup], dict[str, float]]  # the scored groups and the step's rollout metrics

# How each RolloutGroup field travels; a field added to RolloutGroup must be added here (pack refuses otherwise).
_PER_GROUP = ("prompt_ids", "weight_version", "ground_truth", "data_source")
_PER_RESPONSE = ("responses", "engine_logprobs", "finish_reasons", "accs", "scores", "overlong_penalties")
_OPTIONAL_PER_TOKEN = ("token_versions", "loss_masks")  # None, or one list per response, as long as the response
_ROUTING = ("routed_experts",)  # None, or per response an int16 [tokens, layers, k] tensor (or None)
_ROUTING_VALUES = ("routed_experts",)  # the packed tensor that stays on rank 0 (its lengths and shape travel)
# Read by the step's rollout metrics on rank 0 before the batch travels: they stay behind (the defaults arrive).
_METRICS_ONLY = ("source_name", "reward_errors", "reward_timeouts", "reward_extras", "format_weight", "format_matches",
                 "reflections", "tool_use")


def hand_over_rollouts(collect: Callable[[], RolloutBatch], *, what: str) -> RolloutBatch:
    """``collect()`` on rank 0; every rank calls this and returns the same batch (or raises the same Rank0Error),
    but for the engine's routing, whose values only rank 0 keeps (the module docstring)."""
    kept_on_rank0: dict[str, torch.Tensor] = {}

    def collect_and_pack() -> Packed:
        packed = pack_rollout_batch(*collect())
        kept_on_rank0.update(routing_kept_back(packed))
        return packed

    packed = run_on_rank0(collect_and_pack, what=what)
    packed.tensors.update(kept_on_rank0)
    return unpack_rollout_batch(packed)


def routing_kept_back(packed: Packed) -> dict[str, torch.Tensor]:
    """Takes the engine's routing values out of ``packed`` (what crosses keeps their lengths and shapes); returns
    them for the caller to put back."""
    return {name: packed.tensors.pop(name) for name in _ROUTING_VALUES if name in packed.tensors}


def pack_rollout_batch(groups: list[RolloutGroup], metrics: dict[str, float]) -> Packed:
    fields = {f.name for f in dataclasses.fields(RolloutGroup)}
    known = set(_PER_GROUP + _PER_RESPONSE + _OPTIONAL_PER_TOKEN + _ROUTING + _METRICS_ONLY)
    if fields != known:
        raise TypeError(f"pack_rollout_batch does not know RolloutGroup field(s) {sorted(fields ^ known)}")
    for index, group in enumerate(groups):
        counts = {name: len(getattr(group, name)) for name in _PER_RESPONSE}
        if len(set(counts.values())) != 1:
            raise ValueError(f"pack_rollout_batch: group {index} has per-response lists of different lengths {counts}")
        for name in _OPTIONAL_PER_TOKEN:
            values = getattr(group, name)
            if values is not None and [len(v) for v in values] != [len(r) for r in group.responses]:
                raise ValueError(f"pack_rollout_batch: group {index}'s {name} do not match its responses' lengths")
    versioned = [g.token_versions is not None for g in groups]
    responses = [response for g in groups for response in g.responses]
    logprobs = [lps for g in groups for lps in g.engine_logprobs]
    reasons = [reason for g in groups for reason in g.finish_reasons]
    reason_names = sorted(set(reasons))
    tensors = {
        "prompt_ids": _flat([g.prompt_ids for g in groups], torch.int64),
        "prompt_lengths": _lengths([g.prompt_ids for g in groups]),
        "group_sizes": _lengths([g.responses for g in groups]),
        "weight_versions": torch.tensor([g.weight_version for g in groups], dtype=torch.int64),
        "response_ids": _flat(responses, torch.int64),
        "response_lengths": _lengths(responses),
        "engine_logprobs": _flat(logprobs, torch.float64),
        "logprob_lengths": _lengths(logprobs),
        "finish_reasons": torch.tensor([reason_names.index(r) for r in reasons], dtype=torch.int64),
        "accs": torch.tensor([acc for g in groups for acc in g.accs], dtype=torch.bool),
        "scores": torch.tensor([s for g in groups for s in g.scores], dtype=torch.float64),
        "overlong_penalties": torch.tensor([p for g in groups for p in g.overlong_penalties], dtype=torch.float64),
        "has_token_versions": torch.tensor(versioned, dtype=torch.bool),
        "token_versions": _flat([v for g in groups if g.token_versions is not None for v in g.token_versions],
                                torch.int64),
    }
    if any(g.loss_masks is not None for g in groups):  # multi-turn only: a single-turn batch packs as before
        tensors["has_loss_masks"] = torch.tensor([g.loss_masks is not None for g in groups], dtype=torch.bool)
        tensors["loss_masks"] = _flat([m for g in groups if g.loss_masks is not None for m in g.loss_masks],
                                      torch.bool)
    meta = {"ground_truths": [g.ground_truth for g in groups], "data_sources": [g.data_source for g in groups],
            "finish_reason_names": reason_names, "metrics": metrics}
    routed = [r for g in groups for r in (g.routed_experts or [None] * len(g.responses))]
    if any(r is not None for r in routed):  # R3 only: a batch without routing packs as before
        present = [torch.as_tensor(r) for r in routed if r is not None]
        flat = next((tuple(r.shape) for r in present if r.dim() != 3), None)
        if flat is not None:  # SGLang's reply is [tokens, layers * k]: its reader splits it (sglang/requests.py)
            raise ValueError(f"pack_rollout_batch: routed experts of shape {flat}; each response's must be "
                             f"[tokens, layers, top-k]")
        meta["routing_shape"] = tuple(present[0].shape[1:])
        if any(tuple(r.shape[1:]) != meta["routing_shape"] for r in present):
            raise ValueError("pack_rollout_batch: responses' routed experts differ in layers or top-k")
        tensors["has_routed_experts"] = torch.tensor([r is not None for r in routed], dtype=torch.bool)
        tensors["routed_lengths"] = torch.tensor([r.shape[0] for r in present], dtype=torch.int64)
        # as bytes: gloo's broadcast has no int16
        tensors["routed_experts"] = torch.cat([r.to(torch.int16).reshape(-1) for r in present]).view(torch.uint8)
    return Packed({name: _narrowest(tensor) for name, tensor in tensors.items()}, meta)


def unpack_rollout_batch(packed: Packed) -> RolloutBatch:
    t, meta = packed.tensors, packed.meta
    prompts = _views(t["prompt_ids"].long(), t["prompt_lengths"])
    responses = _views(t["response_ids"].long(), t["response_lengths"])
    logprobs = _views(t["engine_logprobs"], t["logprob_lengths"])
    names = meta["finish_reason_names"]
    per_response = {
        "responses": responses, "engine_logprobs": logprobs,
        "finish_reasons": [names[code] for code in t["finish_reasons"].tolist()],
        "accs": t["accs"].tolist(), "scores": t["scores"].double().tolist(),
        "overlong_penalties": t["overlong_penalties"].double().tolist(),
    }
    sizes = t["group_sizes"].tolist()
    by_group = {name: _split(values, sizes) for name, values in per_response.items()}
    versioned = t["has_token_versions"].tolist()
    versioned_lengths = [len(r) for responses, has in zip(by_group["responses"], versioned) if has for r in responses]
    token_versions = iter(_split(_views(t["token_versions"].long(), versioned_lengths),
                                 [size for size, has in zip(sizes, versioned) if has]))
    masked = t["has_loss_masks"].tolist() if "has_loss_masks" in t else [False] * len(sizes)
    masked_lengths = [len(r) for responses, has in zip(by_group["responses"], masked) if has for r in responses]
    loss_masks = iter(_split(_views(t["loss_masks"], masked_lengths), [s for s, has in zip(sizes, masked) if has])
                      if "loss_masks" in t else [])
    routed = _split(_routed_experts(t, meta), sizes)
    groups = [
        RolloutGroup(prompt_ids=prompt, ground_truth=truth, data_source=source, weight_version=version,
                     token_versions=next(token_versions) if has else None,
                     loss_masks=next(loss_masks) if has_mask else None,
                     routed_experts=routed[i] if any(r is not None for r in routed[i]) else None,
                     **{name: by_group[name][i] for name in _PER_RESPONSE})
        for i, (prompt, truth, source, version, has, has_mask) in enumerate(zip(
            prompts, meta["ground_truths"], meta["data_sources"], t["weight_versions"].tolist(), versioned, masked,
            strict=True))
    ]
    return groups, meta["metrics"]


def _routed_experts(t: dict, meta: dict) -> list[torch.Tensor | None]:
    """Per response, its routed experts as a view ``[tokens, layers, k]`` of the flat int16 tensor, or None; where
    the values stayed on rank 0, a ``meta`` tensor of that shape."""
    if "has_routed_experts" not in t:
        return [None] * len(t["response_lengths"])
    shape, lengths = meta["routing_shape"], t["routed_lengths"].tolist()
    if "routed_experts" in t:
        width = shape[0] * shape[1]
        pieces = iter(v.view(-1, *shape) for v in _views(t["routed_experts"].view(torch.int16),
                                                          [n * width for n in lengths]))
    else:
        pieces = iter(torch.empty((n, *shape), dtype=torch.int16, device="meta") for n in lengths)
    return [next(pieces) if has else None for has in t["has_routed_experts"].tolist()]


def _lengths(lists: list[list]) -> torch.Tensor:
    return torch.tensor([len(values) for values in lists], dtype=torch.int64)


def _flat(lists: list, dtype: torch.dtype) -> torch.Tensor:
    """Lists or tensors (a batch unpacked before is packed again) as one flat tensor."""
    if not lists:
        return torch.empty(0, dtype=dtype)
    return torch.cat([torch.as_tensor(values, dtype=dtype).reshape(-1) for values in lists])


def _views(flat: torch.Tensor, lengths: torch.Tensor | list[int]) -> list[torch.Tensor]:
    """``flat`` cut into consecutive pieces of ``lengths``, as views (no copy)."""
    lengths = lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths
    return list(torch.split(flat, lengths)) if lengths else []


def _split(values: list, lengths: list[int]) -> list[list]:
    offsets = list(itertools.accumulate(lengths, initial=0))
    return [values[start:end] for start, end in zip(offsets, offsets[1:])]


def _narrowest(tensor: torch.Tensor) -> torch.Tensor:
    """int64 → int32 and float64 → float32 when every value survives the round trip (halves the bytes sent)."""
    narrow = {torch.int64: torch.int32, torch.float64: torch.float32}.get(tensor.dtype)
    if narrow is None or tensor.numel() == 0:
        return tensor
    if tensor.dtype == torch.int64:
        info = torch.iinfo(narrow)
        fits = bool((tensor >= info.min).all() and (tensor <= info.max).all())
    else:
        fits = torch.equal(tensor.to(narrow).to(tensor.dtype), tensor)
    return tensor.to(narrow) if fits else tensor
