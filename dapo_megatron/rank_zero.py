"""Work global rank 0 does for every rank, and how its result — or its error — reaches them all.

Rank 0 prepares the tiny model, drives the rollout engine and runs validation while the other ranks wait for it in a
collective. An exception kept to rank 0 would leave them blocked there until the collective timeout
(``parallel.collective_timeout_s``, two hours by default), so every such piece of work goes through one of:

* :func:`run_on_rank0` — ``fn()`` on rank 0; every rank returns its result (broadcast) or raises the same
  :class:`Rank0Error`;
* :func:`feed_rank0` — rank 0 hands a *collective stream* (an iterator each step of which runs collectives on every
  rank, e.g. the weight handoff) to a consumer such as ``engine.update_weights``. Every rank reads the stream to its
  end even when the consumer fails part-way, so the other ranks' sends and gathers are matched; then every rank
  returns, or raises the same :class:`Rank0Error`.

In a single process (no process group, or a world of one) both simply run, and raise :class:`Rank0Error` too.

A :class:`~dapo_megatron.user_errors.UserError` (bad input: a data file, a model folder, a server ...) keeps its kind
on every rank: they all raise a :class:`Rank0UserError` with its message, kind and exit code, so every rank of a
torchrun / srun launch exits with the same code and rank 0 prints the one line.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist

from dapo_megatron.user_errors import UserError

T = TypeVar("T")


class Rank0Error(RuntimeError):
    """Rank 0's part of a collective piece of work failed; raised on every rank with the same message."""


class Rank0UserError(Rank0Error, UserError):
    """Rank 0's part failed on bad input: the original message, kind and exit code, on every rank."""

    def __init__(self, message: str, kind: str, exit_code: int) -> None:
        super().__init__(message)
        self.kind, self.exit_code = kind, exit_code


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _share_outcome(result: Any, error: Exception | None, what: str, *, broadcast_result: bool) -> Any:
    """Every rank gets rank 0's result (or keeps its own when not broadcast) or raises the same Rank0Error."""
    if error is None:
        message, user = None, None
    elif isinstance(error, UserError):
        message, user = str(error), (error.kind, error.exit_code)
    else:
        message, user = f"{what} failed on rank 0: {type(error).__name__}: {error}", None
    if _world_size() > 1:
        status = [(result if broadcast_result else None, message, user)]
        dist.broadcast_object_list(status, src=0)
        shared, message, user = status[0]
        if broadcast_result:
            result = shared
    if message is not None:
        raise (Rank0Error(message) if user is None else Rank0UserError(message, *user)) from error
    return result


def run_on_rank0(fn: Callable[[], T], *, what: str, broadcast_result: bool = True) -> T | None:
    """``fn()`` on rank 0 only; every rank calls this. Returns ``fn``'s result on every rank (pickled broadcast), or,
    with ``broadcast_result=False``, on rank 0 only (None elsewhere: e.g. an engine, which cannot travel)."""
    result, error = None, None
    if _rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
    return _share_outcome(result, error, what, broadcast_result=broadcast_result)


def feed_rank0(stream: Iterator, consume: Callable[[Iterator], None], *, what: str) -> None:
    """Rank 0 passes ``stream`` to ``consume``; every rank then reads what is left of ``stream`` (all of it, on ranks
    other than 0). Every rank calls this with its own end of the same collective stream."""
    error = None
    if _rank() == 0:
        try:
            consume(stream)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
    for _ in stream:  # the rest of the stream's collectives, so that no rank waits on a partner that left
        pass
    _share_outcome(None, error, what, broadcast_result=False)
