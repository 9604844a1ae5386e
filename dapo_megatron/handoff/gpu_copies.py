"""The weight handoff to colocated servers with a copy of each bucket on every GPU of the node: each trainer rank
hands the server rank on its own GPU a CUDA IPC handle of its own copy.

Gathered on global rank 0's GPU, a bucket reached only the server rank on GPU 0 by handle (a rank opening a handle of
another GPU makes a CUDA context there): the other seven ranks of a node got it by value, base64 of pickled bytes
through HTTP — ~142 GB per step for the 7B one-node examples (issue 40, item 5). verl and slime broadcast the weights
on the node first; here every trainer rank of the node makes the same buckets itself
(:func:`dapo_megatron.handoff.exporter.export_hf_buckets` with ``every_rank``: all-gathers within its own TP and
expert groups, DP replicas exporting their own copies), and :func:`buckets_with_copies` brings the serialized copies
to rank 0, bucket by bucket, as :class:`~dapo_megatron.hf_format.BucketWithCopies`; the transport then hands each
server rank the copy on its GPU (:func:`dapo_megatron.rollout.sglang.tensor_payloads.entry_gpu`).

Lifetimes: a rank keeps its copy referenced until rank 0 has sent ``window`` more buckets (rank 0 sends a bucket to
every server before it asks for the next, and says so to every rank), then drops it and collects the blocks the
servers released (:data:`dapo_megatron.rollout.sglang.transports.IPC_WINDOW_BUCKETS` for why that is safe).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch.distributed as dist

from dapo_megatron.hf_format import Bucket, BucketWithCopies
from dapo_megatron.rank_zero import waiting_group


@dataclass(frozen=True)
class GpuCopies:
    """How this rank takes part: ``serialize`` its copy of a bucket for the server rank on its GPU (None: no server
    rank shares its GPU, or it is rank 0, whose transport serializes its own), keep ``window`` buckets past rank 0's
    send, ``collect`` the released blocks."""

    serialize: Callable[[Bucket], bytes] | None
    window: int
    collect: Callable[[], None]


def bucket_device(bucket: Bucket) -> int:
    """The device index the bucket's tensors are on (the exporter makes each on the rank's own device)."""
    devices = {tensor.device.index for _, tensor in bucket}
    if len(devices) != 1:
        raise ValueError(f"a bucket on devices {sorted(devices, key=str)}: expected one")
    index = devices.pop()
    return 0 if index is None else index


def buckets_with_copies(buckets: Iterator[Bucket], copies: GpuCopies) -> Iterator[Bucket]:
    """Every rank of the node calls this with its own buckets (the same ones: ``every_rank`` exports) and drains it;
    on global rank 0 it yields each bucket with the other ranks' serialized copies by GPU, elsewhere nothing."""
    group = waiting_group()
    rank = dist.get_rank() if group is not None else 0
    world = dist.get_world_size() if group is not None else 1
    held: deque[Bucket] = deque()
    try:
        for bucket in buckets:
            mine = None
            if copies.serialize is not None:
                bucket = [(name, tensor.detach().contiguous()) for name, tensor in bucket]  # what the handles name
                mine = (bucket_device(bucket), copies.serialize(bucket))
            gathered: list | None = [None] * world if rank == 0 else None
            if group is not None:
                dist.gather_object(mine, gathered, dst=0, group=group)
            if rank == 0:
                yield BucketWithCopies(bucket, dict(entry for entry in gathered or [] if entry is not None))
            sent = [None]
            if group is not None:  # rank 0 resumes here once its servers have the bucket
                dist.broadcast_object_list(sent, src=0, group=group)
            if mine is not None:
                held.append(bucket)
                if len(held) > copies.window:
                    held.popleft()
                    copies.collect()
    finally:
        held.clear()
        copies.collect()
