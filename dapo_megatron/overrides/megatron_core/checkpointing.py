"""Fixes of megatron-core 0.16.1's distributed checkpointing and distributed optimizer, applied where checkpoints are
saved and loaded (:mod:`dapo_megatron.checkpoint.save_load`): the writer's results queue, its writer processes'
lifetime, the optimizer state's layout, and two ways its load mishandles torch Adam's per-parameter ``step``."""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import signal

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

PR_SET_PDEATHSIG = 1  # linux/prctl.h

# How the distributed optimizer lays out its state in a checkpoint. megatron-core 0.16.1's default,
# "fully_sharded_model_space", builds ShardedTensors with ``flattened_range``, which megatron itself rejects
# ("ShardedTensor.flattened_range is not supported"; at DP=1 too). "dp_reshardable" saves each rank's buffers
# as they are, with no communication; it reshards only over DP, and a resume already needs the world size the
# checkpoint was written with (every rank's RNG state is in it). Save and load must name the same layout.
OPTIMIZER_STATE_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def write_results_in_this_process() -> None:
    """Keep megatron-core's checkpoint writes free of a multiprocessing Manager.

    megatron-core 0.16.1 returns the results of its writer processes (forked per save) through a queue it makes, on
    first use, in a spawned Manager process (~280 MB) that lives until the interpreter's exit handlers stop it: a
    trainer ended by a signal leaves it (and the resource tracker it holds open) running with the trainer's stdout,
    so ``dapo-megatron train ... | tee log`` hangs; and a SIGTERM sent to every process of a job kills it first, so
    the checkpoint the trainer then writes fails. A synchronous save, the only kind made here, puts and reads those
    results in the calling process (``AsyncRequest.execute_sync``), where a plain queue carries them."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


_saving_process: int | None = None  # the trainer process whose save forks the writers (set before each save)


def writers_die_with_their_trainer() -> None:
    """megatron-core 0.16.1 forks one writer process per bucket of every save
    (``FileSystemWriterAsync.write_preloaded_data``, from ``write_preloaded_data_multiproc``). A trainer killed in the
    middle of a save — SIGKILL, the watchdog's, the OOM killer, a launcher's teardown — left them running for good:
    each ends in ``count_queue.task_done()``, whose Condition waits for the dead parent to wake (found by
    bench/chaos.py: rank 0 stopped in a checkpoint write left its writers on the node after the restart). Each
    writer now asks the kernel to SIGKILL it when its parent dies (``prctl(PR_SET_PDEATHSIG)``; the save runs in
    the trainer's main thread, whose life the signal follows), and ends at once if the parent is gone already.
    Called before every save, in the process that saves."""
    global _saving_process
    _saving_process = os.getpid()
    write = FileSystemWriterAsync.__dict__["write_preloaded_data"].__func__
    if getattr(write, "dies_with_its_trainer", False):
        return

    @functools.wraps(write)
    def dying_with_the_trainer(*args, **kwargs):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != _saving_process:  # the trainer died between the fork and the prctl
            os._exit(1)
        return write(*args, **kwargs)

    dying_with_the_trainer.dies_with_its_trainer = True
    FileSystemWriterAsync.write_preloaded_data = staticmethod(dying_with_the_trainer)


def reapply_adam_steps(optimizer) -> None:
    """Set torch Adam's per-parameter ``step`` from the param groups the checkpoint restored.

    With torch's Adam (no TE/apex: the CPU path) megatron-core 0.16.1's ``DistributedOptimizer.load_state_dict``
    first sets every ``state[p]["step"]`` from the checkpoint's param groups, then
    ``load_parameter_state_from_dp_reshardable`` copies the step tensors of the pre-load sharded state dict back
    over them (``step`` is not stored per parameter), so a resumed run would continue with the wrong bias
    correction. It also gives every parameter the *same* step tensor, which torch's foreach Adam would then advance
    once per parameter each update: each parameter gets a tensor of its own here. TE/apex FusedAdam keeps the step
    only in the param groups, where this finds no per-parameter step.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        for group in inner.param_groups if inner is not None else []:
            for param in group["params"] if "step" in group else []:
                step = inner.state.get(param, {}).get("step")
                if isinstance(step, torch.Tensor):
                    inner.state[param]["step"] = torch.full_like(step, float(group["step"]))


def give_empty_adam_state(optimizer) -> None:
    """Zero moments and step 0 for every parameter of a torch Adam that has never stepped (a fresh process resuming).

    megatron-core 0.16.1's ``DistributedOptimizer.state_dict`` — which building the load's sharded state dict calls —
    reads the step from torch Adam's per-parameter state when neither TE nor apex provides the optimizer (the CPU
    path, and CUDA without them) and asserts there is exactly one, so a fresh optimizer fails there before anything
    is read. The load then overwrites these tensors in place and :func:`reapply_adam_steps` sets the steps.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if inner.state.get(param):
                    continue
                moments = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
                inner.state[param] = {"step": torch.tensor(0.0), **{name: torch.zeros_like(param) for name in moments}}
