"""Run a test function in N real processes (spawned, gloo), the way torchrun would, and collect the results.

Each process gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, runs ``fn(*args)`` and sends back
its return value, or its traceback, which is re-raised in the test with the failing rank named. Return values are
pickled by value (tensors included), so they outlive the rank that made them.
(Not named ``multiprocess.py``: that would shadow the ``multiprocess`` package HF ``datasets`` imports.)
A deadline turns a hung collective into a test failure instead of a hung CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from typing import Any, Callable

from dapo_megatron.launch_env import free_port


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: mp.Queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        # Plain pickle, not the queue's: torch's multiprocessing reducers would send tensors as shared-memory
        # handles that die with this process.
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from dapo_megatron.platform import destroy_distributed

            destroy_distributed()
        except Exception:  # noqa: BLE001
            pass


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(collected))} gave no result "
                                   f"within {timeout_s:.0f} s") from None
            if status == "ok":
                collected[rank] = pickle.loads(payload)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are likely blocked in a collective with the failed one
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    return [collected[r] for r in range(world_size)]
