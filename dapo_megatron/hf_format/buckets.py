"""Buckets: the unit in which full HF-named tensors travel from the trainer to a rollout engine or a file.

A bucket is a list of ``(hf_name, tensor)`` pairs of at most a given number of bytes (a larger tensor travels
alone). Buckets are made once, by :func:`bucketed` where the tensors are produced (the weight exporter), and
consumed as they are by the engines and transports. A consumer finishes with a bucket before it pulls the next one:
the producer may reuse its memory, and holding one bucket at a time is what bounds the memory of a handoff.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

Bucket = list[tuple[str, torch.Tensor]]


class BucketWithCopies(list):
    """A bucket as the process that sends it holds it, and ``copies``: the same bucket on other GPUs of its node,
    each serialized by the process driving that GPU (GPU index → bytes, e.g. CUDA IPC handles): a transport can hand
    a consumer on such a GPU its local copy instead of the data (:mod:`dapo_megatron.handoff.gpu_copies`)."""

    def __init__(self, bucket: Bucket, copies: dict[int, bytes]) -> None:
        super().__init__(bucket)
        self.copies = copies


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _NameCheck:
    """Every tensor is a ``torch.Tensor`` under a name not seen before in the stream."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, name: str, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in self.seen:
            raise ValueError(f"weight {name!r} appears twice in the exported tensors")
        self.seen.add(name)


def bucketed(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Consecutive tensors grouped into buckets of at most ``bucket_bytes`` (a larger tensor gets a bucket alone);
    a name given twice is an error."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    check = _NameCheck()
    bucket: Bucket = []
    size = 0
    for name, tensor in named_tensors:
        check(name, tensor)
        if bucket and size + nbytes(tensor) > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes(tensor)
    if bucket:
        yield bucket


def checked_buckets(buckets: Iterable[Bucket]) -> Iterator[Bucket]:
    """The buckets as given, one at a time; a non-tensor, a name seen before, or a stream without any tensor is an
    error (the last one raised once the stream ends)."""
    check = _NameCheck()
    for bucket in buckets:
        for name, tensor in bucket:
            check(name, tensor)
        if bucket:
            yield bucket
    if not check.seen:
        raise ValueError("the weight update holds no tensors")
