"""What the backend hands the layers above it, as the interfaces it defines: how the actor lays samples out in rows
(:class:`RowPacker`) and how the weight handoff gathers tensor-parallel shards (:class:`TensorParallelGather`).

They are implemented above: :class:`dapo_megatron.policy.packing.ThdPacker` and
:class:`dapo_megatron.handoff.tp_gather.ProcessGroupGather` (CUDA's, chosen in :mod:`dapo_megatron.cuda.backend`),
:mod:`dapo_megatron.cpu`'s segment packer and shared-memory gather (the CPU backend's). The sample and micro-batch
types are the policy's (:class:`~dapo_megatron.policy.packing.PolicySample`,
:class:`~dapo_megatron.policy.packing.MicroBatch`), typed here as ``Any``: this module imports nothing above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    import torch


class RowPacker(Protocol):
    """How a backend's attention wants samples laid out in rows (see :mod:`dapo_megatron.policy.packing`)."""

    def bins(self, samples: Sequence[Any], indices: Sequence[int], token_budget: int) -> list[list[int]]:
        """The sample indices of each micro-batch; deterministic."""

    def row(self, samples: Sequence[Any], indices: Sequence[int], pad_to_multiple: int) -> Any:
        """One micro-batch holding ``indices`` (none: the filler micro-batch, one padding segment)."""


class ShardGather(Protocol):
    """One export's gather (see :mod:`dapo_megatron.handoff.tp_gather` for the order every TP rank keeps)."""

    def shards(self, index: int, own: torch.Tensor) -> list[torch.Tensor] | None:
        """Every TP rank's ``index``-th shard on the source (``own`` is this rank's), None on the other ranks."""

    def finish(self) -> None:
        """Every TP rank calls it once the export has read every shard."""


class TensorParallelGather(Protocol):
    """How the exporter brings every TP rank's shard of a parameter to the stage's source (TP rank 0)."""

    def open(self, group, shards: Sequence[torch.Tensor]) -> ShardGather:
        """One export's gather over the TP ``group``; every rank of it calls this with its own ``shards``."""
