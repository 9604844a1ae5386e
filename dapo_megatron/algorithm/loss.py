"""The DAPO clipped policy-gradient loss (Clip-Higher, optional dual clip, token-level aggregation). No KL term.

Per response token t of sample i, with r = π_θ / π_θold = exp(logprob − old_logprob) and advantage A:

    ℓ_{i,t} = −min(r·A, clip(r, 1 − eps_low, 1 + eps_high)·A)          (decoupled clip, "Clip-Higher")
    ℓ_{i,t} = min(ℓ_{i,t}, −c·A)            if A < 0 and clip_ratio_c=c  (dual clip: bounds the loss of a
                                                                          negative-advantage token whose ratio exploded)

Gradient w.r.t. the token's log-prob: −A·r where the unclipped term is active, 0 where a clip is active — for A > 0
beyond r > 1 + eps_high, for A < 0 below r < 1 − eps_low, and for A < 0 with dual clip beyond r > c. A token at
p = 0.01 can therefore rise to p = 0.0128 with eps_high = 0.28 (0.012 with 0.2) before its gradient vanishes.

Aggregation (``agg``), with m_{i,t} the loss mask and |o_i| = Σ_t m_{i,t}:

    "token-mean"            Σ_{i,t} m·ℓ / N,  N = num_tokens (global count over micro-batches and DP ranks) or Σ m
                            — DAPO: every token weighs 1/N whatever the length of its answer.
    "seq-mean-token-mean"   Σ_i (Σ_t m·ℓ / |o_i|) / S — GRPO: every answer weighs 1/S.
    "seq-mean-token-sum"    Σ_i (Σ_t m·ℓ) / S.
    S = num_sequences (global count) or the number of sequences here with |o_i| > 0 (a fully masked sequence, e.g.
    an overlong-filtered one, does not count). Pass the global N or S when a batch is split into micro-batches:
    the micro-batch losses then sum to the loss of the whole batch. N and S are clamped to >= 1, so an all-masked
    batch gives loss 0 rather than NaN.

The returned loss is the quantity to minimize (−J). Computation runs in float32; masked-out positions are replaced
before any arithmetic so NaN/inf log-probs at padding cannot leak into the loss or its gradient; the log-ratio is
clamped to [−20, 20] against overflow.

Metrics (plain floats/ints, computed without autograd and read back with a single ``.tolist()``), each a mean over
this call's masked tokens unless noted:
    pg_loss                 the loss value (a sum-able contribution when the global N or S is passed)
    clipfrac_high           fraction of tokens with A > 0 and r > 1 + eps_high (upper clip active)
    clipfrac_low            fraction of tokens with A < 0 and r < 1 − eps_low (lower clip active)
    clipfrac_dual           fraction of tokens with A < 0 and r > c (dual clip active; 0 without clip_ratio_c)
    approx_kl               mean of old_logprob − logprob (verl's ppo_kl)
    ratio_mean              mean of r
    num_masked_tokens       int, Σ m here — the weight for combining the means above across micro-batches
    num_active_sequences    int, sequences here with at least one masked token
``merge_micro_batch_metrics`` combines several calls' metrics with those weights.

The clip ranges are the config's to check (:class:`dapo_megatron.config.AlgorithmConfig` and each objective's
section), once per run: these functions take them as given. The input checks, the masking, the aggregation and the
metrics are the same for every objective of :mod:`dapo_megatron.algorithm.objectives` (``gspo.py`` and ``cispo.py``
use the helpers below); only ℓ_{i,t} and what the clip fractions count differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOG_RATIO_LIMIT = 20.0
TOKEN_MEAN_METRICS = ("clipfrac_high", "clipfrac_low", "clipfrac_dual", "approx_kl", "ratio_mean")
COUNT_METRICS = ("num_masked_tokens", "num_active_sequences")


def check_inputs(name: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                 agg: str) -> None:
    """The shapes every objective takes ([B, T] log-probs and mask, [B] or [B, T] advantages) and a known ``agg``;
    ``name`` (the loss function's) starts each message."""
    if logprobs.dim() != 2:
        raise ValueError(f"{name}: logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    if old_logprobs.shape != shape:
        raise ValueError(f"{name}: old_logprobs shape {tuple(old_logprobs.shape)} != logprobs shape {tuple(shape)}")
    if mask.shape != shape:
        raise ValueError(f"{name}: mask shape {tuple(mask.shape)} != logprobs shape {tuple(shape)}")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(
            f"{name}: advantages must be [B]={shape[0]} or [B, T]={tuple(shape)}, got shape {tuple(advantages.shape)}"
        )
    if agg not in LOSS_AGG_MODES:
        raise ValueError(f"{name}: unknown agg {agg!r}; expected one of {LOSS_AGG_MODES}")


def masked_terms(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(bool mask, float32 weights, float32 [B, T] advantages, float32 log π − log π_old) with every masked-out
    position replaced by 0 before any arithmetic, so NaN/inf log-probs at padding reach neither loss nor gradient.
    The log-ratio carries the graph of ``logprobs`` only."""
    counts = mask.to(torch.bool)
    weights = counts.to(torch.float32)
    advantage = advantages.detach().to(torch.float32)
    if advantage.dim() == 1:
        advantage = advantage.unsqueeze(-1).expand(logprobs.shape)
    log_ratio = torch.where(counts, logprobs.to(torch.float32) - old_logprobs.detach().to(torch.float32), 0.0)
    return counts, weights, torch.where(counts, advantage, 0.0), log_ratio


def _positive_count(name: str, count: int | float | Tensor | None, fallback: Tensor, what: str) -> Tensor | float:
    """The normalizer: ``count`` if given (validated when it is a Python number) else ``fallback``; clamped to >= 1."""
    if count is None:
        return fallback.clamp(min=1.0)
    if isinstance(count, Tensor):
        return count.to(device=fallback.device, dtype=torch.float32).clamp(min=1.0)
    if count < 0:
        raise ValueError(f"{name}: {what} must be >= 0, got {count}")
    return max(float(count), 1.0)


def aggregate(name: str, token_loss: Tensor, weights: Tensor, agg: str, num_tokens: int | Tensor | None,
              num_sequences: int | Tensor | None) -> tuple[Tensor, Tensor]:
    """The batch loss from masked per-token losses ``token_loss`` (0 where masked) by ``agg`` (module docstring),
    and the number of sequences here with at least one loss token."""
    tokens_per_sequence = weights.sum(dim=-1)
    active_sequences = (tokens_per_sequence > 0).to(torch.float32).sum()
    if agg == "token-mean":
        return token_loss.sum() / _positive_count(name, num_tokens, weights.sum(), "num_tokens"), active_sequences
    sequence_loss = token_loss.sum(dim=-1)
    if agg == "seq-mean-token-mean":
        sequence_loss = sequence_loss / tokens_per_sequence.clamp(min=1.0)
    return (sequence_loss.sum() / _positive_count(name, num_sequences, active_sequences, "num_sequences"),
            active_sequences)


@torch.no_grad()
def loss_metrics(loss: Tensor, weights: Tensor, active_sequences: Tensor, *, clipped_high: Tensor,
                 clipped_low: Tensor, clipped_dual: Tensor, log_ratio: Tensor, ratio: Tensor) -> dict[str, float]:
    """The metrics of the module docstring, each token mean over ``weights``, read back with one ``.tolist()``."""
    num_masked = weights.sum()
    denominator = num_masked.clamp(min=1.0)

    def masked_mean(values: Tensor) -> Tensor:
        return (values.to(torch.float32) * weights).sum() / denominator

    stacked = torch.stack([
        loss.detach(), masked_mean(clipped_high), masked_mean(clipped_low), masked_mean(clipped_dual),
        masked_mean(-log_ratio), masked_mean(ratio), num_masked, active_sequences,
    ]).tolist()
    metrics: dict[str, float] = dict(zip(("pg_loss",) + TOKEN_MEAN_METRICS, stacked[:6], strict=True))
    metrics["num_masked_tokens"] = int(stacked[6])
    metrics["num_active_sequences"] = int(stacked[7])
    return metrics


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float | None,
    agg: str,
    num_tokens: int | Tensor | None = None,
    num_sequences: int | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """DAPO policy loss over a [B, T] batch of response tokens (see the module docstring for the formulas).

    Args:
        logprobs: [B, T] log π_θ of the sampled tokens (carries the graph).
        old_logprobs: [B, T] log π_θold of the same tokens (detached here).
        advantages: [B] per-sample or [B, T] per-token advantages (detached here).
        mask: [B, T] bool or numeric, 1 for response tokens that count.
        eps_low, eps_high: the decoupled clip range [1 − eps_low, 1 + eps_high] (0 <= eps_low < 1, eps_high >= 0).
        clip_ratio_c: dual-clip bound c > 1 for negative advantages; None disables it.
        agg: "token-mean" (DAPO), "seq-mean-token-mean" (GRPO) or "seq-mean-token-sum".
        num_tokens: token-mean only — global masked-token count N across micro-batches and DP ranks.
        num_sequences: seq-mean modes only — global count S of sequences with at least one masked token.

    Returns:
        (loss, metrics): a scalar float32 loss to minimize and the metrics listed in the module docstring.
    """
    name = "policy_loss"
    check_inputs(name, logprobs, old_logprobs, advantages, mask, agg)
    counts, weights, advantage, log_ratio = masked_terms(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))

    unclipped_loss = -advantage * ratio
    clipped_loss = -advantage * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    token_loss = torch.maximum(unclipped_loss, clipped_loss)
    if clip_ratio_c is not None:
        token_loss = torch.where(advantage < 0, torch.minimum(token_loss, -advantage * clip_ratio_c), token_loss)
    loss, active_sequences = aggregate(name, token_loss * weights, weights, agg, num_tokens, num_sequences)

    dual_clipped = (advantage < 0) & (ratio > clip_ratio_c) if clip_ratio_c is not None else torch.zeros_like(counts)
    metrics = loss_metrics(
        loss, weights, active_sequences, clipped_high=(advantage > 0) & (ratio > 1.0 + eps_high),
        clipped_low=(advantage < 0) & (ratio < 1.0 - eps_low), clipped_dual=dual_clipped, log_ratio=log_ratio,
        ratio=ratio)
    return loss, metrics


def merge_micro_batch_metrics(per_micro_batch: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine ``policy_loss`` metrics of several micro-batches of one batch.

    Token means are weighted by ``num_masked_tokens``; counts and ``pg_loss`` are summed (``pg_loss`` sums to the
    batch loss when each call got the global ``num_tokens`` / ``num_sequences``).
    """
    if not per_micro_batch:
        raise ValueError("merge_micro_batch_metrics: no metrics to merge")
    total_tokens = sum(metrics["num_masked_tokens"] for metrics in per_micro_batch)
    merged: dict[str, float] = {
        name: sum(metrics[name] * metrics["num_masked_tokens"] for metrics in per_micro_batch) / max(total_tokens, 1)
        for name in TOKEN_MEAN_METRICS
    }
    merged["pg_loss"] = sum(metrics["pg_loss"] for metrics in per_micro_batch)
    for name in COUNT_METRICS:
        merged[name] = sum(metrics[name] for metrics in per_micro_batch)
    return merged
