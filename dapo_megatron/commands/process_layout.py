"""What ``train`` and ``eval`` do the same way before they build anything: the process layout (the backend of this
platform and ``model.kernels`` chosen once, here) and the input checks on rank 0."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from dapo_megatron.platform import FLIGHT_RECORDER_FILE_ENV, ParallelLayout, flight_recorder_env, init_distributed
from dapo_megatron.backend_registry import select_backend
from dapo_megatron.config import DAPOConfig
from dapo_megatron.rank_zero import run_on_rank0
from dapo_megatron.rollout.sglang.gpus import trainer_nccl_env
from dapo_megatron.run.input_checks import check_run_inputs
from dapo_megatron.run.watchdog import collective_limit


def init_process_layout(config: DAPOConfig) -> ParallelLayout:
    """torch.distributed and megatron's parallel state for ``config.parallel``, on the backend ``model.kernels``
    picks here."""
    os.environ.update(trainer_nccl_env(config, cuda_available=torch.cuda.is_available()))  # before any NCCL group
    p = config.parallel
    backend = select_backend(config.model.kernels)
    recorder = flight_recorder_env(config.trainer.run_dir, backend.collective)
    if recorder:  # NCCL: the last collectives of each rank land in the run directory when one times out
        Path(recorder[FLIGHT_RECORDER_FILE_ENV]).parent.mkdir(parents=True, exist_ok=True)
        os.environ.update(recorder)
    # The slow phases' limit: loading, starting servers and the first step may take long; the trainer lowers it.
    return init_distributed(p.tensor, p.pipeline, p.data, expert_parallel=p.expert, backend=backend,
                            timeout_s=collective_limit(p.slow_collective_timeout_s, watched=p.watchdog))


def check_inputs(config: DAPOConfig, backend, **what) -> None:
    """:func:`~dapo_megatron.run.input_checks.check_run_inputs` on rank 0; its error is raised on every rank."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    run_on_rank0(lambda: check_run_inputs(config, world_size=world_size, backend=backend, **what),
                 what="checking the inputs")
