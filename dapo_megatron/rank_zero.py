"""Work global rank 0 does for every rank, and how its result — or its error — reaches them all.

Rank 0 prepares the tiny model, drives the rollout engine and runs validation while the other ranks wait for it. An
exception kept to rank 0 would leave them blocked, so every such piece of work goes through one of:

* :func:`run_on_rank0` — ``fn()`` on rank 0; every rank returns its result (broadcast) or raises the same
  :class:`Rank0Error`;
* :func:`feed_rank0` — rank 0 hands a *collective stream* (an iterator each step of which runs collectives on every
  rank, e.g. the weight handoff) to a consumer such as ``engine.update_weights``. Every rank reads the stream to its
  end even when the consumer fails part-way, so the other ranks' sends and gathers are matched; then every rank
  returns, or raises the same :class:`Rank0Error`.

In a single process (no process group, or a world of one) both simply run, and raise :class:`Rank0Error` too.

The ranks wait in a gloo group of their own (:func:`waiting_group`, made once per process group), whatever the
training backend: generation rounds can outlast the training collectives' timeout, and an NCCL wait would sit on a GPU
under NCCL's watchdog, which aborts the job at that timeout. The gloo wait has a week's timeout and no watchdog; if
rank 0's process dies, its peers see the closed connection at once. A result that is a :class:`Packed` crosses as its
tensors (one broadcast each, no pickling of the bulk) plus its small picklable ``meta``.

A :class:`~dapo_megatron.user_errors.UserError` (bad input: a data file, a model folder, a server ...) keeps its kind
on every rank: they all raise a :class:`Rank0UserError` with its message, kind and exit code, so every rank of a
torchrun / srun launch exits with the same code and rank 0 prints the one line.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from dapo_megatron.user_errors import UserError

T = TypeVar("T")


WAIT_TIMEOUT = datetime.timedelta(days=7)


class Rank0Error(RuntimeError):
    """Rank 0's part of a collective piece of work failed; raised on every rank with the same message."""


@dataclass
class Packed:
    """A result that crosses ranks as ``tensors`` (CPU, one broadcast each) and a small picklable ``meta``."""

    tensors: dict[str, torch.Tensor]
    meta: Any


@dataclass
class _PackedHeader:
    meta: Any
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]]


_waiting: tuple[Any, Any] | None = None  # (the default group it was made for, the gloo group)


def waiting_group():
    """The gloo group every rank waits for rank 0 in, or None in a world of one. Made on first use and again after
    the default group was re-created: every rank asks for it on entering run_on_rank0 / feed_rank0, before rank 0
    runs anything that could make groups of its own, so the group creations stay in the same order on every rank."""
    global _waiting
    if _world_size() == 1:
        return None
    world = dist.group.WORLD
    if _waiting is None or _waiting[0] is not world:
        _waiting = (world, dist.new_group(backend="gloo", timeout=WAIT_TIMEOUT))
    return _waiting[1]


class Rank0UserError(Rank0Error, UserError):
    """Rank 0's part failed on bad input: the original message, kind and exit code, on every rank."""

    def __init__(self, message: str, kind: str, exit_code: int) -> None:
        super().__init__(message)
        self.kind, self.exit_code = kind, exit_code


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _share_outcome(result: Any, error: Exception | None, what: str, *, broadcast_result: bool, group) -> Any:
    """Every rank gets rank 0's result (or keeps its own when not broadcast) or raises the same Rank0Error."""
    if error is None:
        message, user = None, None
    elif isinstance(error, UserError):
        message, user = str(error), (error.kind, error.exit_code)
    else:
        message, user = f"{what} failed on rank 0: {type(error).__name__}: {error}", None
    if group is not None:
        shared = result if broadcast_result and message is None else None
        if isinstance(shared, Packed):
            shared = _PackedHeader(shared.meta, [(k, t.dtype, tuple(t.shape)) for k, t in shared.tensors.items()])
        status = [(shared, message, user)]
        dist.broadcast_object_list(status, src=0, group=group)
        shared, message, user = status[0]
        if isinstance(shared, _PackedHeader):
            shared = _receive_packed(result, shared, group)
        if broadcast_result:
            result = shared
    if message is not None:
        raise (Rank0Error(message) if user is None else Rank0UserError(message, *user)) from error
    return result


def _receive_packed(sent: Any, header: _PackedHeader, group) -> Packed:
    """Rank 0's :class:`Packed` on every rank: rank 0 broadcasts its tensors, the others fill empty ones."""
    if _rank() == 0:
        tensors = {name: tensor.cpu().contiguous() for name, tensor in sent.tensors.items()}
    else:
        tensors = {name: torch.empty(shape, dtype=dtype) for name, dtype, shape in header.specs}
    for tensor in tensors.values():
        if tensor.numel():
            dist.broadcast(tensor, src=0, group=group)
    return Packed(tensors, header.meta)


def run_on_rank0(fn: Callable[[], T], *, what: str, broadcast_result: bool = True) -> T | None:
    """``fn()`` on rank 0 only; every rank calls this. Returns ``fn``'s result on every rank (pickled broadcast; a
    :class:`Packed` result as tensors), or, with ``broadcast_result=False``, on rank 0 only (None elsewhere: e.g. an
    engine, which cannot travel)."""
    group = waiting_group()
    result, error = None, None
    if _rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
    return _share_outcome(result, error, what, broadcast_result=broadcast_result, group=group)


def feed_rank0(stream: Iterator, consume: Callable[[Iterator], None], *, what: str) -> None:
    """Rank 0 passes ``stream`` to ``consume``; every rank then reads what is left of ``stream`` (all of it, on ranks
    other than 0). Every rank calls this with its own end of the same collective stream."""
    group = waiting_group()
    error = None
    if _rank() == 0:
        try:
            consume(stream)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
    for _ in stream:  # the rest of the stream's collectives, so that no rank waits on a partner that left
        pass
    _share_outcome(None, error, what, broadcast_result=False, group=group)
