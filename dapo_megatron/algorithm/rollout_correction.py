"""Rollout correction: what the loss does with tokens the policy did not sample itself.

Every response token t was sampled by the rollout engine with probability π_rollout(t) — at some weight version
v_t, on the engine's kernels. The PPO ratio of the DAPO loss is π_θ / π_old, where π_old is the policy's own
recomputed log-prob at the start of the step (policy version V). π_old ≠ π_rollout for two reasons: the engine's
numerics differ from the trainer's (small), and v_t < V when the token is *stale* — sampled by weights one or more
updates old (async mode; surplus groups kept for a later step in sync mode). Training such tokens with the plain
PPO ratio treats them as if π_old had sampled them. The corrections re-weight them by the ratio of the two
behaviour policies, ρ_t = π_old(t) / π_rollout(t) = exp(logp_old − logp_rollout) (decoupled PPO):

* ``token_tis`` — truncated importance sampling: each token's loss is multiplied by w_t = min(ρ_t, C)
  (C = ``algorithm.tis_cap``). Truncation bounds the variance; w_t ≤ C even when ρ_t explodes.
* ``seq_mis`` — sequence-level masked importance sampling: a response whose geometric-mean ratio
  exp(mean_t log ρ_t) leaves [1/τ, τ] (τ = ``algorithm.mis_threshold``) is dropped from the loss (mask 0);
  the others are trained unweighted.
* ``both`` — the MIS mask, then the TIS weights on what is left.
* ``none`` — no weights; tokens listed as stale (``stale`` argument) are masked out of the loss instead, which is
  what the trainer asks for in async mode without a correction (never trained as if they were on-policy).

How a weight enters the DAPO loss: for w ≥ 0 the clipped token loss satisfies w·ℓ(A) = ℓ(w·A) —
max(−rA, −clip(r)A) and the dual clip min(·, −cA) are positively homogeneous in A, and w·A has the sign of A — so a
weighted token is a token with advantage w_t·A (per-token advantages, :func:`weighted_advantage`), and a masked one
has loss mask 0. GSPO's loss is homogeneous in A the same way and CISPO's is linear in it
(:mod:`dapo_megatron.algorithm.objectives`), so the weights multiply their per-token losses too.
Masked tokens leave the token-mean normalizer too, as the overlong filter's do.

:func:`rollout_correction` returns the per-token weights and keep-masks plus the diagnostics, all computed over the
responses' tokens: the engine–policy KL (k1 = mean(logp_rollout − logp_old), k3 = mean(ρ − 1 − log ρ), both
estimates of KL(π_rollout ‖ π_old) from the engine's samples), ρ's mean/min/max, the mean IS weight of the tokens
still in the loss, the truncated fraction, the masked token and rejected sequence fractions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

CORRECTION_MODES = ("none", "token_tis", "seq_mis", "both")
LOG_RATIO_LIMIT = 20.0  # exp(±20) stays finite in float32


@dataclass
class Correction:
    """Per response, float32 ``[R]`` weights (1 where nothing is weighted) and bool ``[R]`` keep-masks (False:
    out of the loss), and the diagnostics (``rollout_corr/*``)."""

    weights: list[Tensor]
    keep: list[Tensor]
    metrics: dict[str, float]


def _check(policy_logprobs: Sequence[Tensor], rollout_logprobs: Sequence[Tensor], stale: Sequence[Tensor] | None,
           mode: str, tis_cap: float, mis_threshold: float) -> None:
    if mode not in CORRECTION_MODES:
        raise ValueError(f"rollout_correction: unknown mode {mode!r}; expected one of {CORRECTION_MODES}")
    if tis_cap <= 0:
        raise ValueError(f"rollout_correction: tis_cap must be > 0, got {tis_cap}")
    if mis_threshold <= 1:
        raise ValueError(f"rollout_correction: mis_threshold must be > 1, got {mis_threshold}")
    if len(policy_logprobs) != len(rollout_logprobs):
        raise ValueError(f"rollout_correction: {len(policy_logprobs)} policy log-prob rows for "
                         f"{len(rollout_logprobs)} rollout log-prob rows")
    if stale is not None and len(stale) != len(policy_logprobs):
        raise ValueError(f"rollout_correction: {len(stale)} stale masks for {len(policy_logprobs)} responses")
    for i, (policy, rollout) in enumerate(zip(policy_logprobs, rollout_logprobs)):
        if policy.shape != rollout.shape or policy.dim() != 1:
            raise ValueError(f"rollout_correction: response {i} has policy log-probs of shape {tuple(policy.shape)} "
                             f"and rollout log-probs of shape {tuple(rollout.shape)}; both must be [R]")
        if stale is not None and stale[i].shape != policy.shape:
            raise ValueError(f"rollout_correction: response {i} has a stale mask of shape {tuple(stale[i].shape)} "
                             f"for {policy.numel()} tokens")


def rollout_correction(policy_logprobs: Sequence[Tensor], rollout_logprobs: Sequence[Tensor], *, mode: str,
                       tis_cap: float = 2.0, mis_threshold: float = 2.0,
                       stale: Sequence[Tensor] | None = None) -> Correction:
    """Weights and masks for each response (see the module docstring).

    Args:
        policy_logprobs: per response ``[R]``, log π_old of its tokens (the policy's recomputed log-probs).
        rollout_logprobs: per response ``[R]``, log π_rollout — the engine's log-probs when it sampled them.
        mode: "none", "token_tis", "seq_mis" or "both".
        stale: per response bool ``[R]``, True for tokens sampled by older weights than π_old's; with mode "none"
            they are masked out, otherwise they are corrected like every other token.
    """
    _check(policy_logprobs, rollout_logprobs, stale, mode, tis_cap, mis_threshold)
    weights, keep, log_ratios = [], [], []
    rejected = 0
    for i, (policy, rollout) in enumerate(zip(policy_logprobs, rollout_logprobs)):
        log_ratio = (policy.double() - rollout.double()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        log_ratios.append(log_ratio)
        kept = torch.ones(log_ratio.shape, dtype=torch.bool)
        weight = torch.ones(log_ratio.shape, dtype=torch.float64)
        if mode == "none" and stale is not None:
            kept &= ~stale[i].to(torch.bool)
        if mode in ("seq_mis", "both") and log_ratio.numel():
            geometric_mean_ratio = float(log_ratio.mean().exp())
            if not 1.0 / mis_threshold <= geometric_mean_ratio <= mis_threshold:
                kept[:] = False
                rejected += 1
        if mode in ("token_tis", "both"):
            weight = log_ratio.exp().clamp(max=tis_cap)
        weights.append(weight.float())
        keep.append(kept)
    return Correction(weights, keep, _metrics(log_ratios, weights, keep, rejected, tis_cap, mode))


def _metrics(log_ratios: list[Tensor], weights: list[Tensor], keep: list[Tensor], rejected: int, tis_cap: float,
             mode: str) -> dict[str, float]:
    if not log_ratios or not sum(r.numel() for r in log_ratios):
        return {}
    log_ratio = torch.cat(log_ratios)
    ratio = log_ratio.exp()
    kept = torch.cat(keep)
    weight = torch.cat(weights).double()
    metrics = {
        "rollout_corr/kl_k1": float((-log_ratio).mean()),
        "rollout_corr/kl_k3": float((ratio - 1 - log_ratio).mean()),
        "rollout_corr/ratio_mean": float(ratio.mean()),
        "rollout_corr/ratio_min": float(ratio.min()),
        "rollout_corr/ratio_max": float(ratio.max()),
        "rollout_corr/masked_token_fraction": float((~kept).double().mean()),
        "rollout_corr/mis_rejected_fraction": rejected / len(log_ratios),
        "rollout_corr/is_weight_mean": float(weight[kept].mean()) if bool(kept.any()) else float("nan"),
    }
    if mode in ("token_tis", "both"):
        metrics["rollout_corr/tis_truncated_fraction"] = float((ratio > tis_cap).double().mean())
    return metrics


def weighted_advantage(advantage: float, weight: Tensor) -> Tensor:
    """Per-token advantages ``weight · advantage`` (``[R]`` float32): a token of IS weight w_t as the loss sees it."""
    return weight.to(torch.float32) * float(advantage)
