"""How the exporter brings every tensor-parallel rank's shard of a parameter to the stage's source (TP rank 0).

An export opens one :class:`~dapo_megatron.backend.interfaces.ShardGather` over the TP group with the shards it will
ask for, in an order every TP rank shares (:meth:`~dapo_megatron.backend.interfaces.TensorParallelGather.open`, the
interface the backend defines); then every TP rank calls ``shards`` once per shard, in that order — the source gets
the shards of all ranks in rank order, the others None — and ``finish`` at the end. Which gather runs is the
backend's choice (:mod:`dapo_megatron.backend`): :class:`ProcessGroupGather` on CUDA, one ``gather`` per parameter
over the TP process group (NCCL between GPUs); the CPU backend has a faster one for its platform.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from dapo_megatron.backend.interfaces import ShardGather


class _PerParameterGather:
    def __init__(self, group) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.source = dist.get_global_rank(group, 0)
        self.is_source = dist.get_rank(group) == 0

    def shards(self, index: int, own: torch.Tensor) -> list[torch.Tensor] | None:
        own = own.detach().contiguous()  # gloo mis-scatters views
        if self.size == 1:
            return [own]
        gathered = [torch.empty_like(own) for _ in range(self.size)] if self.is_source else None
        dist.gather(own, gathered, dst=self.source, group=self.group)
        return gathered

    def finish(self) -> None:
        """Each gather was complete when it returned."""


class ProcessGroupGather:
    """One ``dist.gather`` per parameter over the TP process group."""

    def open(self, group, shards: Sequence[torch.Tensor]) -> ShardGather:
        return _PerParameterGather(group)


class _PerParameterAllGather(_PerParameterGather):
    def shards(self, index: int, own: torch.Tensor) -> list[torch.Tensor]:
        own = own.detach().contiguous()
        if self.size == 1:
            return [own]
        gathered = [torch.empty_like(own) for _ in range(self.size)]
        dist.all_gather(gathered, own, group=self.group)
        return gathered


class ProcessGroupAllGather:
    """One ``dist.all_gather`` per parameter: every rank of the group gets every shard (an export on every rank,
    :func:`dapo_megatron.handoff.exporter.export_hf_buckets` with ``every_rank``; NCCL between GPUs)."""

    def open(self, group, shards: Sequence[torch.Tensor]) -> ShardGather:
        return _PerParameterAllGather(group)
