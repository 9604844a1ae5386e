"""What ``train`` and ``eval`` do the same way before they build anything: the process layout (the backend of this
platform and ``model.kernels`` chosen once, here) and the input checks on rank 0."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dapo_megatron.platform import ParallelLayout, init_distributed
from dapo_megatron.backend_registry import select_backend
from dapo_megatron.config import DAPOConfig
from dapo_megatron.rank_zero import run_on_rank0
from dapo_megatron.rollout.sglang.gpus import trainer_nccl_env
from dapo_megatron.run.input_checks import check_run_inputs


def init_process_layout(config: DAPOConfig) -> ParallelLayout:
    """torch.distributed and megatron's parallel state for ``config.parallel``, on the backend ``model.kernels``
    picks here."""
    os.environ.update(trainer_nccl_env(config, cuda_available=torch.cuda.is_available()))  # before any NCCL group
    p = config.parallel
    backend = select_backend(config.model.kernels)
    return init_distributed(p.tensor, p.pipeline, p.data, expert_parallel=p.expert, backend=backend,
                            timeout_s=p.collective_timeout_s)


def check_inputs(config: DAPOConfig, backend, **what) -> None:
    """:func:`~dapo_megatron.run.input_checks.check_run_inputs` on rank 0; its error is raised on every rank."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    run_on_rank0(lambda: check_run_inputs(config, world_size=world_size, backend=backend, **what),
                 what="checking the inputs")
