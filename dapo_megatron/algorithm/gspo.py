"""GSPO: the importance ratio and its clip at the level of a whole response (Zheng et al., "Group Sequence Policy
Optimization", Qwen, 2025).

For response i with loss tokens t (mask m_{i,t}, |o_i| = Σ_t m_{i,t}) and advantage A_i:

    s_i = exp( (1/|o_i|) Σ_t m_{i,t} (log π_θ(y_t) − log π_θold(y_t)) )      (geometric mean of the token ratios)
    ℓ_i = −min(s_i·A_i, clip(s_i, 1 − eps_low, 1 + eps_high)·A_i)

The paper's objective is the mean of ℓ_i over the group's responses, with a clip range far narrower than PPO's,
because a sequence ratio moves far less than a token ratio: eps_low = 3e-4, eps_high = 4e-4 (the schema's
``algorithm.gspo`` defaults; DAPO's 0.2 / 0.28 would hardly ever clip).

Gradient: where the clip is not active, ∇ℓ_i = −A_i·s_i·(1/|o_i|) Σ_t ∇log π_θ(y_t) — every token of the response
weighs the same; where it is (A_i > 0 and s_i > 1 + eps_high, or A_i < 0 and s_i < 1 − eps_low) it is 0 for the
whole response.

GSPO-token (``token_level=True``) lets each token carry its own advantage A_{i,t}:

    s_{i,t} = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)]       (same value as s_i; gradient s_i·∇log π_θ(y_t))
    ℓ_{i,t} = −min(s_{i,t}·A_{i,t}, clip(s_{i,t}, 1 − eps_low, 1 + eps_high)·A_{i,t})

With one advantage per response the two have the same value and, under every aggregation below, the same gradient.
They differ once the rollout correction weights tokens (token_tis: per-token advantages w_t·A_i): the token form
scales each token's gradient by its own w_t, the sequence form spreads the response's mean weight over its tokens.

Aggregation: each loss token carries its response's loss (ℓ_{i,t} = ℓ_i, or the token form's ℓ_{i,t}), and ``agg``
means what it means for DAPO (:mod:`dapo_megatron.algorithm.loss`):
    "seq-mean-token-mean"   Σ_i ℓ_i / S — the paper's objective, every response weighs 1/S;
    "token-mean"            Σ_i |o_i|·ℓ_i / N — a response weighs by its length (the token-level normalizer);
    "seq-mean-token-sum"    Σ_i |o_i|·ℓ_i / S.
The sequence ratio is taken over the tokens in the loss: the tokens a rollout-correction or staleness mask drops
leave s_i too (a response with none left is out of the loss). DAPO's dual clip (``clip_ratio_c``) does not apply.

Metrics (token means over the loss tokens, so a response counts with its length): ``clipfrac_high`` / ``clipfrac_low``
the fraction of tokens whose response's clip is active (A > 0, s > 1 + eps_high / A < 0, s < 1 − eps_low),
``clipfrac_dual`` 0, ``approx_kl`` mean(log π_θold − log π_θ) over tokens, ``ratio_mean`` the mean of s_i.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_megatron.algorithm.loss import (
    LOG_RATIO_LIMIT,
    aggregate,
    check_inputs,
    loss_metrics,
    masked_terms,
)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    agg: str,
    token_level: bool,
    num_tokens: int | Tensor | None = None,
    num_sequences: int | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (``token_level=False``) or GSPO-token loss over a [B, T] batch; arguments as
    :func:`dapo_megatron.algorithm.loss.policy_loss`, with ``eps_low`` / ``eps_high`` the sequence-ratio clip range."""
    name = "gspo_loss"
    check_inputs(name, logprobs, old_logprobs, advantages, mask, agg)
    counts, weights, advantage, log_ratio = masked_terms(logprobs, old_logprobs, advantages, mask)
    sequence_log_ratio = (log_ratio.sum(dim=-1) / weights.sum(dim=-1).clamp(min=1.0)).unsqueeze(-1)
    if token_level:
        own = torch.where(counts, logprobs.to(torch.float32), 0.0)
        log_ratio_seen = sequence_log_ratio.detach() + own - own.detach()
    else:
        log_ratio_seen = sequence_log_ratio.expand(log_ratio.shape)
    ratio = torch.exp(log_ratio_seen.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))

    token_loss = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    loss, active_sequences = aggregate(name, token_loss * weights, weights, agg, num_tokens, num_sequences)
    metrics = loss_metrics(
        loss, weights, active_sequences, clipped_high=(advantage > 0) & (ratio > 1.0 + eps_high),
        clipped_low=(advantage < 0) & (ratio < 1.0 - eps_low), clipped_dual=torch.zeros_like(counts),
        log_ratio=log_ratio, ratio=ratio)
    return loss, metrics
