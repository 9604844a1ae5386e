"""The rollout correction of multi-turn responses, over the tokens the engine sampled.

A tool-output token (loss mask 0, :mod:`dapo_megatron.rollout.multi_turn`) has no engine log-prob: it was appended,
not sampled. Its ratio π_old/π_rollout means nothing, so it must not enter the correction's weights, its
sequence-level mean (``seq_mis``) or its diagnostics. :func:`correction_of_sampled` runs
:func:`~dapo_megatron.algorithm.rollout_correction.rollout_correction` on the sampled tokens of each response and
spreads the result back over the whole response: weight 1 and keep False on tool tokens (the loss mask drops them
anyway). Responses without a mask go through unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dapo_megatron.algorithm.rollout_correction import Correction, rollout_correction


def correction_of_sampled(policy_logprobs: Sequence[Tensor], rollout_logprobs: Sequence[Tensor],
                          sampled: Sequence[Tensor | None], *, stale: Sequence[Tensor] | None = None,
                          **settings) -> Correction:
    """:func:`rollout_correction` (``settings``: mode, tis_cap, mis_threshold) over the tokens where ``sampled``
    (bool ``[R]`` per response, None: all) is True."""
    if all(mask is None for mask in sampled):
        return rollout_correction(policy_logprobs, rollout_logprobs, stale=stale, **settings)

    def pick(values: Sequence[Tensor]) -> list[Tensor]:
        return [v if mask is None else v[mask.to(v.device)] for v, mask in zip(values, sampled, strict=True)]

    inner = rollout_correction(pick(policy_logprobs), pick(rollout_logprobs),
                               stale=pick(stale) if stale is not None else None, **settings)
    weights, keep = [], []
    for weight, kept, mask, policy in zip(inner.weights, inner.keep, sampled, policy_logprobs):
        if mask is None:
            weights.append(weight)
            keep.append(kept)
            continue
        mask = mask.to(weight.device)
        full_weight = torch.ones(policy.shape, dtype=weight.dtype, device=weight.device)
        full_keep = torch.zeros(policy.shape, dtype=torch.bool, device=kept.device)
        full_weight[mask], full_keep[mask] = weight, kept
        weights.append(full_weight)
        keep.append(full_keep)
    return Correction(weights, keep, inner.metrics)
