"""The batch layout the embedded engine decodes: left-padded prompts and a KV cache preallocated for the whole decode.

* A chunk of rows is left-padded to its longest prompt ``P``. Row ``b`` with prompt length ``L_b`` has ``P - L_b``
  pad slots; its real tokens get positions ``0 .. L_b - 1`` (a cumulative sum over the pad mask) and the token
  generated at step ``t`` gets position ``L_b + t``, so RoPE sees exactly what it sees for the prompt alone.
* Attention masks are 4D booleans (True = attend) handed to the model as-is: a real query attends causally to real
  keys only; a pad query attends only to itself. That keeps the (unused) hidden states of pad slots finite on every
  SDPA backend: some return NaN for a fully masked row (torch 2.13's CPU kernel returns zeros), and a NaN value in a
  pad slot would poison real rows, since NaN times a zero attention weight is NaN.
* The KV cache holds ``P + max_new_tokens - 1`` slots per row from the start and is written in place; each step
  attends to a view of the filled prefix. HF's growing cache concatenates every layer's K and V each step, which
  dominated the decode time of a ~1M-parameter model (74% of it at 256 rows).
* The prefill (:func:`prefill`) runs each distinct prefix once and copies its cache rows and logits to the rows
  that share it: the ``n`` samples of a prompt are ``n`` rows with the same prompt.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from dapo_megatron.rollout.engine import RolloutError

if TYPE_CHECKING:
    from dapo_megatron.rollout.embedded.routing_capture import RoutingCapture


class PreallocatedKVLayer(DynamicLayer):
    """One layer's KV cache with room for ``capacity`` positions, written in place.

    ``update`` stores the new keys/values at the next free slots and returns views ``[B, H, filled, D]`` of the
    filled prefix, so decoding never concatenates. ``batch_select_indices`` keeps a subset of rows (finished rows
    leaving the batch).
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.filled = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, key_dim = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_empty(batch, heads, self.capacity, key_dim)
        self.values = value_states.new_empty(batch, heads, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, stop = self.filled, self.filled + key_states.shape[-2]
        if stop > self.capacity:
            raise RolloutError(f"KV cache overflow: {stop} positions written into a cache of {self.capacity}")
        self.keys[:, :, start:stop] = key_states
        self.values[:, :, start:stop] = value_states
        self.filled = stop
        return self.keys[:, :, :stop], self.values[:, :, :stop]

    def get_seq_length(self) -> int:
        return self.filled

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys = self.keys[indices]
            self.values = self.values[indices]


def preallocated_kv_cache(num_layers: int, capacity: int) -> Cache:
    return Cache(layers=[PreallocatedKVLayer(capacity) for _ in range(num_layers)])


@dataclass
class LeftPaddedBatch:
    """A chunk of prompts left-padded to a common length ``P``, with room for ``max_new_tokens`` more positions.

    ``key_valid[b, j]`` says whether cache slot ``j`` of row ``b`` holds a real token. Slots past ``P`` (generated
    tokens) are all valid: at step ``t`` only slots ``< P + t + 1`` are attended, and those are filled.
    """

    input_ids: torch.Tensor  # [B, P] int64
    key_valid: torch.Tensor  # [B, P + max_new_tokens] bool
    prompt_lengths: torch.Tensor  # [B] int64

    @classmethod
    def build(cls, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_token_id: int) -> "LeftPaddedBatch":
        prompt_lengths = torch.tensor([len(prompt) for prompt in prompts], dtype=torch.int64)
        padded_length = int(prompt_lengths.max())
        real = torch.arange(padded_length)[None, :] >= (padded_length - prompt_lengths)[:, None]
        input_ids = torch.full((len(prompts), padded_length), pad_token_id, dtype=torch.int64)
        input_ids[real] = torch.tensor(list(itertools.chain.from_iterable(prompts)), dtype=torch.int64)  # row-major
        key_valid = torch.cat([real, torch.ones(len(prompts), max_new_tokens, dtype=torch.bool)], dim=1)
        return cls(input_ids=input_ids, key_valid=key_valid, prompt_lengths=prompt_lengths)

    @property
    def padded_length(self) -> int:
        return self.input_ids.shape[1]


def prefix_position_ids(key_valid: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` positions of a left-padded prefix whose real slots are ``key_valid [B, S]``: real tokens numbered
    from 0, pads at 0. The prompt, or (re-prefilling after a weight update) the prompt and the tokens so far."""
    return (key_valid.long().cumsum(dim=-1) - 1).clamp_(min=0)


def prefix_attention_mask(key_valid: torch.Tensor) -> torch.Tensor:
    """``[B, 1, S, S]`` bool for the prefix of :func:`prefix_position_ids`: causal among real tokens; a pad query
    sees only itself."""
    length = key_valid.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril_()
    diagonal = torch.eye(length, dtype=torch.bool)
    return (causal & key_valid[:, None, None, :]) | diagonal


def prefill(model: torch.nn.Module, input_ids: torch.Tensor, key_valid: torch.Tensor, cache: Cache,
            capture: "RoutingCapture | None" = None) -> tuple[Cache, torch.Tensor]:
    """Fill the empty ``cache`` with the rows' left-padded prefixes ``input_ids [B, S]`` (the prompt, or after a weight
    update the prompt and the tokens so far) under the model's current weights; returns it and the logits of the
    next token ``[B, V]``. ``key_valid`` is the rows' ``[B, ≥S]`` slot mask of :class:`LeftPaddedBatch`.

    Rows with the same prefix — the ``n`` samples of a prompt — run through the model once and their cache rows
    and logits are copied: a prefill of ``B`` rows costs as much as its distinct prefixes. ``capture``: its
    ``routing`` becomes the prefixes' expert ids, ``[B, S, layers, k]``, copied to the rows the same way.
    """
    prefix_valid = key_valid[:, : input_ids.shape[1]]
    # Pads become -1 so that two prefixes are one only when their real tokens and their pad slots match.
    distinct, row_of = torch.unique(input_ids.masked_fill(~prefix_valid, -1), dim=0, return_inverse=True)
    shared = len(distinct) < len(input_ids)
    if shared:
        # one row of each prefix (which one does not matter: they are equal)
        representative = torch.empty(len(distinct), dtype=torch.int64).scatter_(0, row_of, torch.arange(len(input_ids)))
        input_ids, prefix_valid = input_ids[representative], prefix_valid[representative]
    logits = model(
        input_ids=input_ids,
        attention_mask=prefix_attention_mask(prefix_valid),
        position_ids=prefix_position_ids(prefix_valid),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    if capture is not None:
        capture.routing = capture.take(*input_ids.shape)
        capture.routing = capture.routing[row_of] if shared else capture.routing
    if shared:
        for layer in cache.layers:
            layer.batch_select_indices(row_of)
        logits = logits[row_of]
    return cache, logits
