"""megatron's training wrappers around one model stage, from the run config's ``optim`` and ``parallel`` sections.

:func:`wrap_for_training` wraps the stage in megatron's ``DistributedDataParallel`` (:func:`ddp_config`) and builds the
Megatron optimizer (Adam with decoupled weight decay and gradient clipping, optionally the distributed optimizer) and
its ``OptimizerParamScheduler``: update ``k`` (counting applied updates from 1) uses ``lr · min(k, warmup) / warmup``,
then ``lr``. The actor (:mod:`dapo_megatron.policy.actor`) runs the schedule on what this returns.

Communication overlap (``parallel.overlap_grad_reduce`` / ``overlap_param_gather``), as megatron's own training
loop wires it (megatron-core 0.16.1, ``distributed_data_parallel.py``, ``pipeline_parallel/schedules.py``):

* grad reduce: the DDP backward hooks start each bucket's reduce-scatter/all-reduce as soon as its gradients are
  complete — in the LAST micro-batch only, which the schedule marks by running the others inside
  ``config.no_sync_func`` (set here to ``ddp_model.no_sync``); ``finalize_model_grads`` waits for them.
* param gather (distributed optimizer): after ``step_with_ready_grads`` each rank holds only its own shard of the
  updated parameters; the all-gather runs bucket by bucket from forward pre-hooks of the NEXT training forward
  (re-armed by ``zero_grad_buffer``). Anything else that reads the weights first — a forward-only pass, the weight
  handoff — must call :func:`sync_params` before.

One update: the actor computes the gradient norm itself (``prepare_grads`` + ``get_grad_norm``, one model-parallel
all-reduce) to decide whether to skip the step, then applies it with
:func:`dapo_megatron.overrides.megatron_core.optimizer_step.clip_and_step` (the rest of megatron's ``step()`` given
that norm, which ``step()`` itself would compute again).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

if TYPE_CHECKING:
    from dapo_megatron.config import OptimConfig


def ddp_config(*, use_distributed_optimizer: bool, overlap_grad_reduce: bool = False,
               overlap_param_gather: bool = False):
    """megatron ``DistributedDataParallelConfig``: fp32 gradient reduction, the overlap switches as given."""

    if overlap_param_gather and not use_distributed_optimizer:
        raise ValueError("overlap_param_gather needs the distributed optimizer (it overlaps ITS parameter all-gather)")
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=use_distributed_optimizer,
    )


def wrap_for_training(stage: torch.nn.Module, optim: "OptimConfig", *, use_distributed_optimizer: bool,
                      overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                      lr_multiplier: float = 1.0):
    """``(DistributedDataParallel(stage), optimizer, scheduler)``; the stage is an unwrapped ``GPTModel``.

    Only the parameters that require a gradient are trained: megatron's DDP gives the others no gradient buffer and
    its optimizer no main copy or moments (with LoRA,
    :func:`dapo_megatron.policy.lora.adapter.add_adapters` froze the base).
    ``lr_multiplier`` scales ``optim.lr`` (``model.lora.lr_multiplier``: adapters train at a higher rate)."""

    tconfig = stage.config
    lr = optim.lr * lr_multiplier
    ddp_model = DistributedDataParallel(
        tconfig, ddp_config(use_distributed_optimizer=use_distributed_optimizer,
                            overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather),
        stage)
    # Without this the schedule never all-reduces DP gradients (replicas drift apart).
    tconfig.finalize_model_grads_func = finalize_model_grads
    if overlap_grad_reduce:
        tconfig.no_sync_func = ddp_model.no_sync  # the schedule marks the last micro-batch; the hooks then reduce
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=lr,
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
        init_lr=0.0 if optim.warmup_steps else lr,
        max_lr=lr,
        min_lr=lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=optim.warmup_steps + 1,  # unused by the constant style; must exceed warmup
        lr_decay_style="constant",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return ddp_model, optimizer, scheduler


def sync_params(ddp_model) -> bool:
    """Finish the parameter all-gather now when it is deferred to the next forward (``overlap_param_gather``).

    Returns whether it ran. A synchronous gather (``start_param_sync(force_sync=True)``) is cheap next to a
    weight handoff and always correct: it waits for an all-gather in flight, or gathers every bucket.
    """
    config = getattr(ddp_model, "ddp_config", None)
    if config is None or not (config.use_distributed_optimizer and config.overlap_param_gather):
        return False
    ddp_model.start_param_sync(force_sync=True)
    return True


def training_state_bytes(ddp_model, optimizer) -> dict[str, int]:
    """Bytes this rank holds for training, measured on the objects: ``weights`` (every parameter of the stage),
    ``grad_buffers`` (megatron DDP's gradient buffers: only parameters that require a gradient get a slot),
    ``main_params`` (the optimizer's fp32 copies of 16-bit parameters) and ``moments`` (Adam's state tensors, which
    exist once a step was applied). With LoRA the last three are the adapters' alone."""
    def size(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    grad_buffers = sum(size(buffer.grad_data) for buffer in ddp_model.buffers + ddp_model.expert_parallel_buffers)
    main_params = moments = 0
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        for groups in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            main_params += sum(size(param) for group in getattr(chained, groups, None) or [] for param in group)
        for state in chained.optimizer.state.values():
            moments += sum(size(value) for value in state.values() if isinstance(value, torch.Tensor)
                           and value.dim() > 0)
    return {"weights": sum(size(param) for param in ddp_model.module.parameters()), "grad_buffers": grad_buffers,
            "main_params": main_params, "moments": moments}
