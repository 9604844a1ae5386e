"""The two row layouts the project's packers are measured and tested against; neither is used to train.

* :class:`MaskPacker` — megatron's plain local ``DotProductAttention`` with a dense mask: first-fit decreasing rows
  (like :class:`dapo_megatron.policy.packing.ThdPacker`) whose block-diagonal causal ``attention_mask [1, 1, S, S]``
  (True = masked) keeps each sample to itself. The local attention masks scores where the mask is True
  (``masked_fill(mask, -10000)``) and, when a mask is given, adds no causal mask of its own. Rotary scores depend only
  on the distance between query and key and attention never crosses a sample boundary, so each sample's outputs equal
  those of the sample run alone (up to the rounding of the rotary angles) although RoPE rotates by row position.
  Attention costs ``S²`` per row.
* :class:`PaddedPacker` — one sample per row, ``samples_per_micro_batch`` consecutive samples per micro-batch,
  right-padded to the longest; plain causal attention (right padding is never seen by real tokens).

Both are :class:`~dapo_megatron.backend.interfaces.RowPacker`\\ s: pass one where the backend's packer goes
(``plan_data_parallel``, ``pack_micro_batches``, or an ``Actor``'s ``backend.packer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dapo_megatron.policy.packing import (
    PAD_TOKEN_ID,
    MicroBatch,
    PolicySample,
    ThdPacker,
    concatenated_row,
    response_tensors,
    round_up,
)


class MaskPacker(ThdPacker):
    """ThdPacker's rows with a dense block-diagonal causal mask instead of sequence boundaries."""

    def row(self, samples: Sequence[PolicySample], indices: Sequence[int], pad_to_multiple: int) -> MicroBatch:
        tokens, labels, positions, starts, segment_lengths = concatenated_row(samples, indices, pad_to_multiple)
        total = tokens.numel()
        segment = torch.repeat_interleave(torch.arange(len(segment_lengths)), torch.tensor(segment_lengths))
        allowed = (segment[:, None] == segment[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
        return MicroBatch(tokens[None], positions[None], labels[None], (~allowed)[None, None], None,
                          *response_tensors(samples, indices, starts), sample_indices=tuple(indices),
                          num_real_tokens=sum(samples[i].length for i in indices))


@dataclass(frozen=True)
class PaddedPacker:
    """``samples_per_micro_batch`` right-padded rows per micro-batch (the token budget is not used)."""

    samples_per_micro_batch: int

    def __post_init__(self) -> None:
        if self.samples_per_micro_batch < 1:
            raise ValueError(f"samples_per_micro_batch must be >= 1, got {self.samples_per_micro_batch}")

    def bins(self, samples: Sequence[PolicySample], indices: Sequence[int], token_budget: int) -> list[list[int]]:
        step = self.samples_per_micro_batch
        return [list(indices[begin:begin + step]) for begin in range(0, len(indices), step)]

    def row(self, samples: Sequence[PolicySample], indices: Sequence[int], pad_to_multiple: int) -> MicroBatch:
        if not indices:  # the filler: one padding row
            length = round_up(1, pad_to_multiple)
            return MicroBatch(torch.full((1, length), PAD_TOKEN_ID, dtype=torch.long), torch.arange(length)[None],
                              torch.zeros(1, length, dtype=torch.long), None, None, *response_tensors([], [], []),
                              sample_indices=(), num_real_tokens=0)
        width = round_up(max(samples[i].length for i in indices), pad_to_multiple)
        tokens = torch.full((len(indices), width), PAD_TOKEN_ID, dtype=torch.long)
        labels = torch.zeros(len(indices), width, dtype=torch.long)
        for row, index in enumerate(indices):
            ids = torch.cat([samples[index].prompt_ids, samples[index].response_ids])
            tokens[row, :ids.numel()] = ids
            labels[row, :ids.numel() - 1] = ids[1:]
        positions = torch.arange(width).expand(len(indices), width).contiguous()
        return MicroBatch(tokens, positions, labels, None, None,
                          *response_tensors(samples, indices, [row * width for row in range(len(indices))]),
                          sample_indices=tuple(indices), num_real_tokens=sum(samples[i].length for i in indices))
