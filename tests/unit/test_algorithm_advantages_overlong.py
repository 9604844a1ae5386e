"""Group advantages and overlong reward shaping (soft punishment and filtering)."""

import pytest
import torch

from loss_settings import ADVANTAGE_EPS, policy_loss

from dapo_megatron.algorithm import group_advantages
from dapo_megatron.reward.overlong import overlong_filter_mask, overlong_penalty
from dapo_megatron.reward.rule import math_reward

torch.set_num_threads(1)


def test_group_advantages_values():
    rewards = torch.tensor([[1.0, -1.0, -1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.5, -1.0, 1.0, -1.0]])
    advantages = group_advantages(rewards, eps=ADVANTAGE_EPS)
    std = (4 / 3) ** 0.5  # unbiased std of (1, -1, -1, 1)
    assert torch.allclose(advantages[0], torch.tensor([1, -1, -1, 1]) / (std + 1e-6))
    assert torch.equal(advantages[1], torch.zeros(4))  # all-equal group: exactly zero, not NaN
    expected = (rewards[2] - rewards[2].mean()) / (rewards[2].std(unbiased=True) + 1e-6)
    assert torch.allclose(advantages[2], expected)
    assert torch.allclose(advantages.sum(dim=1), torch.zeros(3), atol=1e-6)


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_groups, G"):
        group_advantages(torch.ones(4), eps=ADVANTAGE_EPS)
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.ones(3, 1), eps=ADVANTAGE_EPS)


def test_overlong_penalty_worked_number():
    """Seed: L_max 20,480, L_cache 4,096: a correct 18,432-token answer scores +1 − 0.5 = +0.5."""
    penalty = overlong_penalty(torch.tensor([18_432]), max_len=20_480, cache_len=4_096)
    total = math_reward("Answer: 18", "18").score + penalty.item()
    assert total == pytest.approx(0.5)


def test_overlong_penalty_shape():
    lengths = torch.tensor([0, 16_384, 16_385, 18_432, 20_480, 20_481, 50_000])
    penalty = overlong_penalty(lengths, max_len=20_480, cache_len=4_096, factor=1.0)
    expected = torch.tensor([0.0, 0.0, -1 / 4096, -0.5, -1.0, -1.0, -1.0])
    assert torch.allclose(penalty, expected)
    assert torch.allclose(overlong_penalty(lengths, 20_480, 4_096, factor=0.5), 0.5 * expected)
    full_window = overlong_penalty(torch.tensor([0, 10, 20]), max_len=20, cache_len=20)
    assert torch.allclose(full_window, torch.tensor([0.0, -0.5, -1.0]))


def test_overlong_penalty_validates():
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, cache_len=0)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, cache_len=11)
    with pytest.raises(ValueError, match="factor"):
        overlong_penalty(torch.tensor([1]), max_len=10, cache_len=5, factor=-1.0)


def test_overlong_filter_mask_zeroes_truncated_rows():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    truncated = torch.tensor([False, True, False])
    filtered = overlong_filter_mask(mask, truncated)
    assert filtered.dtype == torch.bool
    assert filtered.tolist() == [[True, True, False], [False, False, False], [True, False, False]]
    assert torch.equal(overlong_filter_mask(mask.float(), truncated), filtered.float())
    assert mask[1].all()  # input untouched


def test_overlong_filtered_samples_get_no_gradient():
    logprobs = torch.randn(3, 5, requires_grad=True)
    mask = overlong_filter_mask(torch.ones(3, 5), torch.tensor([False, True, False]))
    loss, metrics = policy_loss(logprobs, logprobs.detach() - 0.1, torch.tensor([1.0, -1.0, 0.5]), mask)
    loss.backward()
    assert torch.all(logprobs.grad[1] == 0) and torch.all(logprobs.grad[0] != 0)
    assert metrics["num_masked_tokens"] == 10 and metrics["num_active_sequences"] == 2


def test_overlong_filter_mask_validates():
    with pytest.raises(TypeError, match="bool"):
        overlong_filter_mask(torch.ones(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="truncated must be"):
        overlong_filter_mask(torch.ones(2, 3), torch.tensor([True]))
