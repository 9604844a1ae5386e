"""Rollout correction (token TIS, sequence MIS) and staleness accounting, against numbers computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from loss_settings import policy_loss

from dapo_megatron.algorithm.rollout_correction import rollout_correction, weighted_advantage
from dapo_megatron.algorithm.staleness import (
    response_staleness,
    stale_token_mask,
    staleness_metrics,
    version_span,
)

# Two responses. Log-ratios log(π_old / π_rollout): response 0 → [0.2, -1.0, 0.0], response 1 → [-2.0, -1.5].
POLICY = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-3.0, -3.0])]
ROLLOUT = [torch.tensor([-1.2, -1.0, -0.5]), torch.tensor([-1.0, -1.5])]


def test_token_tis_weights_are_the_ratio_truncated_at_the_cap():
    correction = rollout_correction(POLICY, ROLLOUT, mode="token_tis", tis_cap=1.1)
    assert correction.weights[0].tolist() == pytest.approx([1.1, math.exp(-1.0), 1.0], abs=1e-6)  # e^0.2 = 1.22 > 1.1
    assert correction.weights[1].tolist() == pytest.approx([math.exp(-2.0), math.exp(-1.5)], abs=1e-6)
    assert all(bool(k.all()) for k in correction.keep)  # TIS weights, never masks
    m = correction.metrics
    assert m["rollout_corr/tis_truncated_fraction"] == pytest.approx(1 / 5)
    expected_mean = (1.1 + math.exp(-1) + 1 + math.exp(-2) + math.exp(-1.5)) / 5
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(expected_mean)


def test_seq_mis_drops_the_response_whose_geometric_mean_ratio_leaves_the_band():
    correction = rollout_correction(POLICY, ROLLOUT, mode="seq_mis", mis_threshold=2.0)
    # response 0: exp(mean(0.2, -1, 0)) = exp(-0.2667) = 0.766 ∈ [0.5, 2] → kept; response 1: exp(-1.75) = 0.174 → out
    assert correction.keep[0].tolist() == [True, True, True]
    assert correction.keep[1].tolist() == [False, False]
    assert [w.tolist() for w in correction.weights] == [[1.0, 1.0, 1.0], [1.0, 1.0]]  # MIS masks, never weights
    assert correction.metrics["rollout_corr/mis_rejected_fraction"] == 0.5
    assert correction.metrics["rollout_corr/masked_token_fraction"] == pytest.approx(2 / 5)
    # control: a looser band (τ = 6 > 1/0.174) keeps both
    assert all(bool(k.all()) for k in rollout_correction(POLICY, ROLLOUT, mode="seq_mis", mis_threshold=6.0).keep)


def test_both_masks_then_weights():
    correction = rollout_correction(POLICY, ROLLOUT, mode="both", tis_cap=2.0, mis_threshold=2.0)
    assert correction.keep[1].tolist() == [False, False]
    assert correction.weights[0].tolist() == pytest.approx([math.exp(0.2), math.exp(-1.0), 1.0], abs=1e-6)
    assert correction.metrics["rollout_corr/is_weight_mean"] == pytest.approx((math.exp(0.2) + math.exp(-1) + 1) / 3)


def test_none_masks_only_the_tokens_it_is_told_are_stale():
    stale = [torch.tensor([True, True, False]), torch.tensor([False, False])]
    correction = rollout_correction(POLICY, ROLLOUT, mode="none", stale=stale)
    assert [k.tolist() for k in correction.keep] == [[False, False, True], [True, True]]
    assert [w.tolist() for w in correction.weights] == [[1.0, 1.0, 1.0], [1.0, 1.0]]
    plain = rollout_correction(POLICY, ROLLOUT, mode="none")
    assert all(bool(k.all()) for k in plain.keep) and plain.metrics["rollout_corr/masked_token_fraction"] == 0.0


def test_engine_policy_diagnostics_by_hand():
    m = rollout_correction(POLICY, ROLLOUT, mode="none").metrics
    log_ratios = [0.2, -1.0, 0.0, -2.0, -1.5]
    assert m["rollout_corr/kl_k1"] == pytest.approx(-sum(log_ratios) / 5)
    assert m["rollout_corr/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in log_ratios) / 5)
    assert m["rollout_corr/ratio_mean"] == pytest.approx(sum(math.exp(x) for x in log_ratios) / 5)
    assert m["rollout_corr/ratio_min"] == pytest.approx(math.exp(-2.0))
    assert m["rollout_corr/ratio_max"] == pytest.approx(math.exp(0.2))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="unknown mode"):
        rollout_correction(POLICY, ROLLOUT, mode="tis")
    with pytest.raises(ValueError, match="response 1"):
        rollout_correction(POLICY, [ROLLOUT[0], torch.zeros(3)], mode="token_tis")
    with pytest.raises(ValueError, match="mis_threshold"):
        rollout_correction(POLICY, ROLLOUT, mode="seq_mis", mis_threshold=1.0)


def test_an_is_weight_enters_the_dapo_loss_as_a_per_token_advantage_factor():
    """w·ℓ(A) = ℓ(w·A) for the clipped loss with dual clip: weighting by advantage is exact, in every clip regime."""
    # ratios r = exp(logp − old): 1.5 (upper clip for A>0), 0.5 (lower clip for A<0), 12 (dual clip for A<0), 1.1
    old = torch.zeros(1, 4, dtype=torch.float64)
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 12.0, 1.1]], dtype=torch.float64))
    advantages = torch.tensor([[1.0, -1.0, -1.0, 0.5]], dtype=torch.float64)
    weights = torch.tensor([0.3, 1.7, 2.0, 0.9])
    mask = torch.ones(1, 4)
    kwargs = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0, num_tokens=4)
    weighted_loss, _ = policy_loss(logprobs, old, advantages * weights.double(), mask, **kwargs)
    per_token = [policy_loss(logprobs[:, i:i + 1], old[:, i:i + 1], advantages[:, i:i + 1], torch.ones(1, 1),
                             **{**kwargs, "num_tokens": 1})[0].item() for i in range(4)]
    expected = sum(weight * loss for weight, loss in zip(weights.tolist(), per_token)) / 4
    assert weighted_loss.item() == pytest.approx(expected)
    assert weighted_advantage(-2.0, torch.tensor([0.5, 1.5])).tolist() == [-1.0, -3.0]


def test_staleness_is_counted_against_the_policy_version():
    assert response_staleness([3, 3, 3], policy_version=3) == 0
    assert response_staleness([2, 2, 3], policy_version=3) == 1  # the oldest token counts
    assert response_staleness([1, 2], policy_version=4) == 3
    assert version_span([2, 2, 3, 3]) == 1 and version_span([5]) == 0
    assert stale_token_mask([2, 2, 3], policy_version=3).tolist() == [True, True, False]
    with pytest.raises(ValueError, match="newer than the policy"):
        response_staleness([4], policy_version=3)
    with pytest.raises(ValueError, match="must not decrease"):
        version_span([3, 2])


def test_staleness_histogram():
    m = staleness_metrics([0, 1, 1, 3])
    assert m == {"rollout/staleness/mean": 1.25, "rollout/staleness/max": 3.0, "rollout/staleness/hist/0": 0.25,
                 "rollout/staleness/hist/1": 0.5, "rollout/staleness/hist/2": 0.0, "rollout/staleness/hist/3": 0.25}
    assert staleness_metrics([]) == {}
