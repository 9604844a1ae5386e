"""CISPO: clip the importance-sampling weight, not the update (MiniMax, "MiniMax-M1", 2025).

Per loss token t of response i, with r_{i,t} = π_θ(y_t) / π_θold(y_t) and advantage A_{i,t}:

    ℓ_{i,t} = −sg( clip(r_{i,t}, 1 − eps_low_is, 1 + eps_high_is) ) · A_{i,t} · log π_θ(y_t)

The weight is a constant to the gradient (sg: stop-gradient), so ∇ℓ_{i,t} = −r̂_{i,t}·A_{i,t}·∇log π_θ(y_t) for
every token: no token's gradient is dropped, however far its ratio moved — where PPO/DAPO's clip zeroes it, CISPO only
bounds its weight. That keeps the rare high-entropy "fork" tokens (However, Wait, Recheck) learning after the first
update of a step, which is what the paper introduced it for.

Defaults (the schema's ``algorithm.cispo``): eps_low_is = 1.0 — the weight's lower bound 1 − 1 = 0 is no bound at
all (r ≥ 0), as MiniMax-M1 trains ("we did not impose a lower bound on the IS weight by setting ε_low_IS to a large
value"); eps_high_is = 3.0, a weight cap of 4: the paper tunes ε_high_IS without publishing it, and 4 is the
upper bound Tinker's CISPO loss documents as its default (tinker-docs.thinkingmachines.ai, losses/cispo). A cap well
above PPO's 1.28 is the point: only rare, far-moved tokens are truncated.

The value of the loss contains log π_θ, so ``pg_loss`` is not on the scale of DAPO's or GSPO's (it is positive for
a positive advantage whatever the ratio); compare CISPO runs with CISPO runs. Aggregation as for DAPO (the paper:
token-mean, every token of the batch weighs 1/N). DAPO's dual clip (``clip_ratio_c``) does not apply: the weight is
bounded by 1 + eps_high_is already.

Metrics (token means over the loss tokens): ``clipfrac_high`` the fraction of tokens whose weight was truncated at
1 + eps_high_is (whatever the sign of A: the weight is truncated, the gradient kept), ``clipfrac_low`` those raised
to 1 − eps_low_is (0 with the default), ``clipfrac_dual`` 0, ``approx_kl`` mean(log π_θold − log π_θ),
``ratio_mean`` the mean of r_{i,t} before truncation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_megatron.algorithm.loss import LOG_RATIO_LIMIT, aggregate, check_inputs, loss_metrics, masked_terms


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low_is: float,
    eps_high_is: float,
    agg: str,
    num_tokens: int | Tensor | None = None,
    num_sequences: int | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO loss over a [B, T] batch; arguments as :func:`dapo_megatron.algorithm.loss.policy_loss`, with
    [1 − eps_low_is, 1 + eps_high_is] the range the stop-gradient IS weight is clipped to."""
    name = "cispo_loss"
    check_inputs(name, logprobs, old_logprobs, advantages, mask, agg)
    counts, weights, advantage, log_ratio = masked_terms(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(log_ratio.detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    is_weight = ratio.clamp(max(1.0 - eps_low_is, 0.0), 1.0 + eps_high_is)
    own = torch.where(counts, logprobs.to(torch.float32), 0.0)

    token_loss = -is_weight * advantage * own
    loss, active_sequences = aggregate(name, token_loss * weights, weights, agg, num_tokens, num_sequences)
    metrics = loss_metrics(
        loss, weights, active_sequences, clipped_high=ratio > 1.0 + eps_high_is,
        clipped_low=ratio < 1.0 - eps_low_is, clipped_dual=torch.zeros_like(counts), log_ratio=log_ratio,
        ratio=ratio)
    return loss, metrics
