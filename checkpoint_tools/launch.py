"""Run one conversion function on every rank of a TP×PP world.

Three ways a conversion runs, chosen by how it was started:

* under ``torchrun`` (or SLURM with RANK/WORLD_SIZE exported): this process *is* one rank — the function runs here
  and the launcher owns the process group;
* a world of one: the function runs in this process, with a private rendezvous on a free port;
* otherwise: ``world_size`` processes are spawned (``multiprocessing`` spawn; each sets RANK/WORLD_SIZE/… like
  torchrun would, binds its GPU when there is CUDA, else uses gloo on the CPU). The first rank to fail stops the
  others, so a rank blocked in a collective with a failed peer never hangs the conversion; its error is re-raised
  here — as :class:`ConversionError` when it was one (bad input), else as :class:`RankFailedError` with its traceback.

The function is called as ``fn(environ, *args)``: ``environ`` is the launch environment to pass to
``dapo_megatron.platform.init_distributed`` (``None``: the process environment). It must leave torch.distributed
initialized when it returns; whoever created the process group destroys it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from checkpoint_tools.errors import ConversionError
from dapo_megatron.hf_format.writer import staging_dir
from dapo_megatron.launch_env import free_port, launch_env

RankFn = Callable[..., None]
_POLL_S = 1.0
_DRAIN_S = 5.0  # how long to wait for a dead rank's last message before calling it killed


class RankFailedError(RuntimeError):
    """A rank failed with an unexpected error (a bug or the machine: out of memory, killed)."""


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    error_type: str | None = None  # None: the rank finished
    message: str = ""
    traceback: str = ""
    bad_input: bool = False


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when this process is already one rank of a launched world (the platform module decides how to read it)."""
    return launch_env(environ).launcher == "torchrun"


def _rank_environ(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def quiet_backend_warnings() -> None:
    """Silence what every rank would repeat and no user can act on: megatron-core's notes that TE/apex are absent
    and about config defaults, and torch's deprecation notices for the checkpoint API megatron-core calls."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*(load_state_dict. is deprecated|use DTensor)")


def _destroy_process_group() -> None:
    from dapo_megatron.platform import destroy_distributed

    destroy_distributed()


def _spawned_rank(fn: RankFn, rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
    os.environ.update(_rank_environ(rank, world_size, port))
    quiet_backend_warnings()
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # the ranks share this machine's cores
    try:
        fn(None, *args)
        results.put(RankOutcome(rank))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        results.put(RankOutcome(rank, type(exc).__name__, str(exc), traceback.format_exc(),
                                isinstance(exc, ConversionError)))
    finally:
        try:
            _destroy_process_group()
        except Exception:  # noqa: BLE001 - the outcome is already reported
            pass


def _raise_for(outcome: RankOutcome) -> None:
    if outcome.bad_input:
        raise ConversionError(outcome.message)
    raise RankFailedError(f"rank {outcome.rank} failed with {outcome.error_type}: {outcome.message}\n"
                          f"--- traceback of rank {outcome.rank} ---\n{outcome.traceback}")


def _wait(procs: list, results: Any) -> None:
    pending = set(range(len(procs)))
    while pending:
        try:
            outcome: RankOutcome = results.get(timeout=_POLL_S)
        except queue.Empty:
            dead = [r for r in sorted(pending) if procs[r].exitcode is not None]
            if not dead:
                continue
            try:  # a rank that exited may still have its message in flight
                outcome = results.get(timeout=_DRAIN_S)
            except queue.Empty:
                rank = dead[0]
                raise RankFailedError(
                    f"rank {rank} exited with code {procs[rank].exitcode} without reporting (killed, or out of memory?)"
                ) from None
        if outcome.error_type is not None:
            _raise_for(outcome)
        pending.discard(outcome.rank)


def run_ranks(fn: RankFn, world_size: int, *args: Any) -> None:
    """Run ``fn(environ, *args)`` on every rank of a ``world_size`` world (see the module docstring)."""
    if launched_by_torchrun():
        fn(None, *args)
        return
    if world_size == 1:
        with warnings.catch_warnings():
            quiet_backend_warnings()
            try:
                fn(_rank_environ(0, 1, free_port()), *args)
            finally:
                _destroy_process_group()
        return
    import torch

    if torch.cuda.is_available() and world_size > torch.cuda.device_count():
        raise ConversionError(f"{world_size} ranks need {world_size} GPUs, this machine has "
                              f"{torch.cuda.device_count()}: lower --tp/--pp or use torchrun over several nodes")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawned_rank, args=(fn, rank, world_size, port, args, results), daemon=False)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    finished = False
    try:
        _wait(procs, results)
        finished = True
    finally:
        for proc in procs:
            if finished:
                proc.join()
            elif proc.is_alive():
                proc.kill()
                proc.join()


def shared_staging_dir(staging: Path | None, out: Path) -> Path:
    """The staging folder on every rank: the one the spawning parent made, or one rank 0 makes (under torchrun)."""
    import torch.distributed as dist

    if staging is not None:
        return staging
    box = [str(staging_dir(out)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def agree_on_error(error: str | None) -> None:
    """Every rank raises the same :class:`ConversionError` when any rank reports one (so none waits alone)."""
    import torch.distributed as dist

    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    reported = [e for e in errors if e is not None]
    if reported:
        raise ConversionError(reported[0])
