"""How the actor's mini-batch becomes this DP rank's micro-batches.

The actor hands every DP rank the WHOLE mini-batch. megatron's DDP needs every DP rank to run the same number of
micro-batches, so :func:`plan_data_parallel` splits the samples over DP ranks by tokens (longest first, each to the
least-loaded rank), builds this rank's micro-batches with the backend's
:class:`~dapo_megatron.backend.interfaces.RowPacker`, and pads ranks with fewer micro-batches with the packer's filler
(one padding segment, no response tokens). Every rank computes every rank's count from the sample lengths alone: no
communication.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Sequence

from dapo_megatron.backend.interfaces import RowPacker
from dapo_megatron.policy.packing import MicroBatch, PolicySample, pack_micro_batches, packing_efficiency


@dataclass(frozen=True)
class PackedBatching:
    """Micro-batches of at most ``token_budget`` tokens (the trainer's: ``trainer.micro_batch_tokens``).

    ``pad_to_multiple``: every row's length is a multiple of it (the actor raises it to the TP size under sequence
    parallelism).
    """

    token_budget: int
    pad_to_multiple: int = 1


def split_for_data_parallel(lengths: Sequence[int], data_parallel: int) -> list[list[int]]:
    """Indices split over DP ranks with balanced token counts: longest first, each to the least-loaded rank.

    Ties go to the lowest rank; each rank's indices are returned in input order. Deterministic.
    """
    if data_parallel < 1:
        raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
    loads = [0] * data_parallel
    shares: list[list[int]] = [[] for _ in range(data_parallel)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(data_parallel), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += lengths[index]
    return [sorted(share) for share in shares]


@dataclass
class DataParallelPlan:
    """This DP rank's micro-batches (padded with empty ones to the count every rank runs) and batch-wide counts."""

    micro_batches: list[MicroBatch]
    num_loss_tokens: int  # Σ loss-mask tokens over the whole mini-batch (all DP ranks)
    num_loss_sequences: int  # samples with at least one loss token, whole mini-batch
    num_empty: int  # empty micro-batches added on this rank
    rank_indices: list[int] = field(default_factory=list)  # this rank's sample indices

    @property
    def efficiency(self) -> float:
        return packing_efficiency(self.micro_batches)


def _micro_batch_count(samples: Sequence[PolicySample], share: list[int], batching: PackedBatching,
                       packer: RowPacker) -> int:
    if not share:
        return 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rank that owns an oversize sample warns when it packs it
        return len(packer.bins(samples, share, batching.token_budget))


def plan_data_parallel(
    samples: Sequence[PolicySample],
    batching: PackedBatching,
    packer: RowPacker,
    *,
    data_parallel: int,
    data_parallel_rank: int,
    vocab_size: int | None = None,
) -> DataParallelPlan:
    """Split the mini-batch (the same list on every rank) over DP ranks and build this rank's micro-batches.

    Every rank computes every rank's micro-batch count from the sample lengths alone, so the counts agree without
    communication; ranks below the maximum get filler micro-batches.
    """
    if not 0 <= data_parallel_rank < data_parallel:
        raise ValueError(f"data_parallel_rank {data_parallel_rank} is outside [0, {data_parallel})")
    if not samples:
        raise ValueError("plan_data_parallel: the mini-batch has no samples")
    if batching.pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {batching.pad_to_multiple}")
    lengths = [sample.length for sample in samples]
    shares = split_for_data_parallel(lengths, data_parallel)
    target = max(_micro_batch_count(samples, share, batching, packer) for share in shares)
    mine = shares[data_parallel_rank]
    micro_batches = pack_micro_batches(samples, packer, token_budget=batching.token_budget,
                                       pad_to_multiple=batching.pad_to_multiple, indices=mine,
                                       vocab_size=vocab_size) if mine else []
    num_empty = target - len(micro_batches)
    micro_batches += [packer.row(samples, [], batching.pad_to_multiple) for _ in range(num_empty)]
    loss_tokens = [sample.num_loss_tokens for sample in samples]
    return DataParallelPlan(
        micro_batches=micro_batches,
        num_loss_tokens=sum(loss_tokens),
        num_loss_sequences=sum(1 for n in loss_tokens if n > 0),
        num_empty=num_empty,
        rank_indices=mine,
    )
