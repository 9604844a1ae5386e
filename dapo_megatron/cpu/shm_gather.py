"""The CPU backend's tensor-parallel gather for the weight handoff: shards through shared memory on one host.

The exporter (:mod:`dapo_megatron.handoff.exporter`) needs every TP rank's shard of each parameter on TP rank 0.
Over gloo that is a ``gather`` per parameter through the loopback TCP stack: each byte is copied into the kernel,
across and out again, in chunks, with a round trip per parameter. Ranks on the same host can do better: each copies
all its shards once into a shared-memory file (``/dev/shm``), one barrier publishes them, and TP rank 0 reads them
in place (the un-interleave that follows makes the one copy the HF tensors need anyway).

:class:`SharedMemoryGather` (a :class:`~dapo_megatron.backend.interfaces.TensorParallelGather`) sets this up once
per TP group and shard layout, and falls back to the process-group gather where it does not apply (one TP rank, CUDA
tensors, ranks on several hosts, not enough space in ``/dev/shm``). The file is unlinked as soon as every rank has
mapped it, so nothing is
left behind even if a process dies; the mapping (about this rank's share of the model) is reused by every later
export.
"""

from __future__ import annotations

import mmap
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from dapo_megatron.backend.interfaces import ShardGather
from dapo_megatron.handoff.tp_gather import ProcessGroupGather
from dapo_megatron.hf_format.buckets import nbytes

SHM_DIR = "/dev/shm"
_ALIGN = 64  # every shard starts on a cache line, so any dtype view of it is aligned


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class _Mapping:
    buffer: torch.Tensor  # uint8 view of the whole file: one region per TP rank except rank 0
    region: int  # bytes per rank


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{socket.gethostname()}:{boot.read().strip()}"
    except OSError:
        return socket.gethostname()


def _map(path: str, size: int, create: bool) -> torch.Tensor:
    fd = os.open(path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        view = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(view, dtype=torch.uint8, count=size)


class _SharedMemoryExport:
    """One export's gather: every rank stages its shards (``stage``); TP rank 0 then reads each parameter's shards
    (``shards``) and everyone meets again when it is done (``finish``)."""

    def __init__(self, group, rank: int, world: int, mapping: _Mapping, layout: list[tuple[int, int]]):
        self.group, self.rank, self.world = group, rank, world
        self.mapping = mapping
        self.layout = layout  # (offset, nbytes) of each shard inside a region

    def stage(self, shards: Sequence[torch.Tensor]) -> None:
        if self.rank > 0:
            region = self.mapping.buffer[(self.rank - 1) * self.mapping.region:][:self.mapping.region]
            for shard, (offset, size) in zip(shards, self.layout, strict=True):
                region[offset:offset + size].view(shard.dtype).view(shard.shape).copy_(shard)
        dist.barrier(group=self.group)  # every region is written

    def shards(self, index: int, own: torch.Tensor) -> list[torch.Tensor] | None:
        """On TP rank 0: the ``index``-th shard of every rank, in rank order (peers' shards read in place)."""
        if self.rank > 0:
            return None
        offset, size = self.layout[index]
        peers = [self.mapping.buffer[r * self.mapping.region + offset:][:size].view(own.dtype).view(own.shape)
                 for r in range(self.world - 1)]
        return [own.detach(), *peers]

    def finish(self) -> None:
        dist.barrier(group=self.group)  # rank 0 has read everything: the regions may be written again


class SharedMemoryGather:
    """The shared-memory gather, with the process-group gather where it does not apply (see the module docstring).
    It keeps each TP group's mapping (about this rank's share of the model) for the exports that follow."""

    def __init__(self) -> None:
        self._mappings: dict[tuple, _Mapping] = {}
        self._same_host: dict[tuple, bool] = {}
        self._fallback = ProcessGroupGather()

    def open(self, group, shards: Sequence[torch.Tensor]) -> ShardGather:
        world = dist.get_world_size(group)
        # Every TP rank of a job decides alike: all on CPU over gloo, or not.
        if world == 1 or dist.get_backend(group) != "gloo" or any(shard.device.type != "cpu" for shard in shards):
            return self._fallback.open(group, shards)
        ranks = tuple(dist.get_process_group_ranks(group))
        if not self._ranks_share_a_host(group, ranks):
            return self._fallback.open(group, shards)
        rank = dist.get_rank(group)
        layout, offset = [], 0
        for shard in shards:
            layout.append((offset, nbytes(shard)))
            offset += _aligned(nbytes(shard))
        key = (ranks, tuple(layout))
        mapping = self._mappings.get(key) or self._create_mapping(group, rank, world, key, max(offset, _ALIGN))
        if mapping is None:
            return self._fallback.open(group, shards)
        export = _SharedMemoryExport(group, rank, world, mapping, layout)
        export.stage(shards)
        return export

    def _ranks_share_a_host(self, group, ranks: tuple[int, ...]) -> bool:
        if ranks not in self._same_host:
            hosts: list = [None] * len(ranks)
            dist.all_gather_object(hosts, _host_id(), group=group)
            self._same_host[ranks] = len(set(hosts)) == 1
        return self._same_host[ranks]

    def _create_mapping(self, group, rank: int, world: int, key: tuple, region: int) -> _Mapping | None:
        """TP rank 0 creates the file (when /dev/shm has room), every rank maps it, rank 0 unlinks it."""
        size = region * (world - 1)
        header: list = [None]
        buffer = None
        if rank == 0:
            stat = os.statvfs(SHM_DIR) if os.path.isdir(SHM_DIR) else None
            if stat is not None and stat.f_bavail * stat.f_frsize >= size * 2:  # keep room for everyone else
                path = os.path.join(SHM_DIR, f"dapo_megatron_handoff_{uuid.uuid4().hex}")
                try:
                    buffer = _map(path, size, create=True)
                    header[0] = path
                except OSError:  # no shared memory after all: every rank falls back to the process group
                    if os.path.exists(path):
                        os.unlink(path)
        dist.broadcast_object_list(header, src=dist.get_global_rank(group, 0), group=group)
        path = header[0]
        if path is None:
            return None
        if rank > 0:
            buffer = _map(path, size, create=False)
        dist.barrier(group=group)  # everyone has mapped it
        if rank == 0:
            os.unlink(path)
        for stale in [k for k in self._mappings if k[0] == key[0]]:
            del self._mappings[stale]  # one mapping per TP group: a new layout replaces the old one
        self._mappings[key] = _Mapping(buffer, region)
        return self._mappings[key]
