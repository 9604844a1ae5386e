"""megatron's training wrappers around one model stage, from the run config's ``optim`` section.

:func:`wrap_for_training` wraps the stage in megatron's ``DistributedDataParallel`` and builds the Megatron optimizer
(Adam with decoupled weight decay and gradient clipping, optionally the distributed optimizer) and its
``OptimizerParamScheduler``: update ``k`` (counting applied updates from 1) uses ``lr · min(k, warmup) / warmup``,
then ``lr``. The actor (:mod:`dapo_megatron.policy.actor`) runs the schedule on what this returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dapo_megatron.config import OptimConfig


def wrap_for_training(stage: torch.nn.Module, optim: "OptimConfig", *, use_distributed_optimizer: bool):
    """``(DistributedDataParallel(stage), optimizer, scheduler)``; the stage is an unwrapped ``GPTModel``."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    tconfig = stage.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    ddp_model = DistributedDataParallel(tconfig, ddp_config, stage)
    # Without this the schedule never all-reduces DP gradients (replicas drift apart).
    tconfig.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            min_lr=optim.lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps,
            clip_grad=optim.grad_clip,
            use_distributed_optimizer=use_distributed_optimizer,
            bf16=tconfig.bf16,
            fp16=False,
            params_dtype=tconfig.params_dtype,
        ),
        [ddp_model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=optim.warmup_steps + 1,  # unused by the constant style; must exceed warmup
        lr_decay_style="constant",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return ddp_model, optimizer, scheduler
