"""The rest of megatron-core 0.16.1's optimizer ``step()`` given a gradient norm already computed.

megatron's ``step()`` (``MixedPrecisionOptimizer``, ``FP32Optimizer``, ``ChainedOptimizer``) takes no norm: it runs
``prepare_grads`` and computes the total norm inside ``clip_grad_norm`` itself. The actor
(:mod:`dapo_megatron.policy.actor`) needs that norm before deciding whether to step at all (the NaN guard), so it
runs ``prepare_grads`` + ``get_grad_norm`` (one model-parallel all-reduce) and calls :func:`clip_and_step`, which
re-implements what ``step()`` does after that point rather than paying for the norm twice.
"""

from __future__ import annotations

from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32


def clip_and_step(optimizer, grad_norm: float) -> bool:
    """Clip by the already computed total ``grad_norm``, then step; returns whether the update was applied.

    megatron-core 0.16.1's ``step()`` is ``prepare_grads`` → norm and ``clip_grad_by_total_norm_fp32`` over each
    optimizer's parameters (when ``clip_grad > 0``) → ``step_with_ready_grads``; the caller has done the first two
    (once), this does the rest.
    """

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(part, "is_stub_optimizer", False) or part.config.clip_grad <= 0.0:
            continue
        params = part.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(
                params, max_norm=part.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    return optimizer.step_with_ready_grads()
