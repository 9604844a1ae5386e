"""The DAPO policy loss: Clip-Higher, dual clip, token-level aggregation, checked through gradients."""

import math

import pytest
import torch

from loss_settings import policy_loss

from dapo_megatron.algorithm import merge_micro_batch_metrics

torch.set_num_threads(1)


def _grad(logprobs, old_logprobs, advantages, mask, **kwargs):
    logprobs = logprobs.clone().requires_grad_(True)
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, **kwargs)
    loss.backward()
    return loss, logprobs.grad, metrics


def _single_token_grad(new_prob, old_prob, advantage, **kwargs):
    """d loss / d logprob for one token with probability old_prob -> new_prob."""
    logprobs = torch.tensor([[math.log(new_prob)]], dtype=torch.float64)
    old = torch.tensor([[math.log(old_prob)]], dtype=torch.float64)
    _, grad, _ = _grad(logprobs, old, torch.tensor([advantage]), torch.ones(1, 1), **kwargs)
    return grad.item()


@pytest.mark.parametrize("eps_high,ceiling", [(0.28, 0.0128), (0.2, 0.012)])
def test_clip_higher_worked_number(eps_high, ceiling):
    """Seed: a token at p=0.01 can rise to 0.0128 with eps_high=0.28 and to 0.012 with 0.2 (A > 0)."""
    below, above = ceiling * 0.995, ceiling * 1.005
    grad_below = _single_token_grad(below, 0.01, 1.0, eps_high=eps_high)
    assert grad_below == pytest.approx(-below / 0.01)  # still pushed up: -A·r
    assert _single_token_grad(above, 0.01, 1.0, eps_high=eps_high) == 0.0  # clipped: no further push


def test_token_weights_worked_number():
    """Seed: answers of 100 and 1,000 tokens; token-mean weighs every token 1/1,100, seq-mean 1/200 and 1/2,000."""
    lengths = (100, 1000)
    mask = torch.zeros(2, 1000)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    old = torch.randn(2, 1000, dtype=torch.float64)
    advantages = torch.ones(2)

    _, grad, _ = _grad(old.clone(), old, advantages, mask, agg="token-mean")
    assert torch.allclose(grad[0, :100], torch.full((100,), -1 / 1100, dtype=torch.float64))
    assert torch.allclose(grad[1], torch.full((1000,), -1 / 1100, dtype=torch.float64))
    assert torch.all(grad[0, 100:] == 0)

    _, grad, _ = _grad(old.clone(), old, advantages, mask, agg="seq-mean-token-mean")
    assert torch.allclose(grad[0, :100], torch.full((100,), -1 / 200, dtype=torch.float64))
    assert torch.allclose(grad[1], torch.full((1000,), -1 / 2000, dtype=torch.float64))

    _, grad, _ = _grad(old.clone(), old, advantages, mask, agg="seq-mean-token-sum")
    assert torch.allclose(grad[mask.bool()], torch.full((1100,), -1 / 2, dtype=torch.float64))


def _hand_gradient(logprobs, old, advantages, mask, eps_low, eps_high, clip_ratio_c, denominator):
    """d loss / d logprob derived by hand: −A·r on the unclipped side, 0 where a clip is active; / N."""
    ratio = torch.exp(logprobs - old)
    adv = advantages.unsqueeze(-1).expand_as(ratio)
    active = torch.where(adv > 0, ratio <= 1 + eps_high, ratio >= 1 - eps_low)
    if clip_ratio_c is not None:
        active &= ~((adv < 0) & (ratio > clip_ratio_c))
    return torch.where(active, -adv * ratio, torch.zeros_like(ratio)) * mask / denominator


@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_autograd_matches_hand_gradient(clip_ratio_c):
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(5, 7, generator=generator, dtype=torch.float64) - 2
    log_ratio = torch.empty(5, 7, dtype=torch.float64).uniform_(-1.5, 1.5, generator=generator)
    ratio = log_ratio.exp()
    boundaries = torch.tensor([0.8, 1.28, 3.0], dtype=torch.float64)
    assert (ratio.unsqueeze(-1) - boundaries).abs().min() > 1e-3, "inputs too close to a clip boundary"
    logprobs = old + log_ratio
    advantages = torch.tensor([1.3, -0.7, 0.0, -2.0, 0.4], dtype=torch.float64)
    mask = (torch.rand(5, 7, generator=generator) > 0.25).to(torch.float64)

    loss, grad, _ = _grad(logprobs, old, advantages, mask, clip_ratio_c=clip_ratio_c)
    expected = _hand_gradient(logprobs, old, advantages, mask, 0.2, 0.28, clip_ratio_c, mask.sum())
    assert torch.allclose(grad.to(torch.float64), expected, atol=1e-6)
    assert (expected != 0).sum() > 5 and (expected[mask.bool()] == 0).sum() > 3  # both sides exercised

    adv = advantages.unsqueeze(-1)
    token_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    if clip_ratio_c is not None:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -adv * clip_ratio_c), token_loss)
    assert loss.item() == pytest.approx(((token_loss * mask).sum() / mask.sum()).item(), rel=1e-6)


@pytest.mark.parametrize(
    "advantage,ratio,clipped",
    [
        (1.0, 1.5, True),  # A > 0: upper clip stops pushing up
        (1.0, 0.5, False),  # A > 0: below 1 − eps_low the token is still pushed up
        (-1.0, 0.5, True),  # A < 0: lower clip stops pushing down
        (-1.0, 1.5, False),  # A < 0: above 1 + eps_high the token is still pushed down
    ],
)
def test_clip_is_one_sided(advantage, ratio, clipped):
    grad = _single_token_grad(0.1 * ratio, 0.1, advantage)
    if clipped:
        assert grad == 0.0
    else:
        assert grad == pytest.approx(-advantage * ratio)


def test_dual_clip_caps_negative_advantage_loss():
    logprobs = torch.tensor([[math.log(20.0), math.log(5.0), math.log(20.0)]], dtype=torch.float64)
    old = torch.zeros(1, 3, dtype=torch.float64)
    advantages = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)

    loss, grad, metrics = _grad(logprobs, old, advantages, mask, clip_ratio_c=10.0, agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx(10.0 + 5.0 - 1.28)  # capped at −c·A; r=5 below c; A>0 upper clip
    assert grad[0].tolist() == pytest.approx([0.0, 5.0, 0.0])
    assert metrics["clipfrac_dual"] == pytest.approx(1 / 3)

    assert _grad(logprobs, old, advantages, mask, agg="seq-mean-token-sum")[0].item() == pytest.approx(loss.item())
    # the default is the schema's (c = 10, the reference recipe); None turns the dual clip off
    loss, grad, metrics = _grad(logprobs, old, advantages, mask, clip_ratio_c=None, agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx(20.0 + 5.0 - 1.28)
    assert grad[0].tolist() == pytest.approx([20.0, 5.0, 0.0])
    assert metrics["clipfrac_dual"] == 0.0


def _random_batch(seed, batch=6, length=9):
    generator = torch.Generator().manual_seed(seed)
    old = torch.randn(batch, length, generator=generator) - 2
    logprobs = old + 0.4 * torch.randn(batch, length, generator=generator)
    advantages = torch.randn(batch, generator=generator)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(-1)
    mask[2] = False  # an overlong-filtered sample
    return logprobs, old, advantages, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_with_global_count_equal_full_batch(agg):
    logprobs, old, advantages, mask = _random_batch(1)
    full_loss, full_grad, full_metrics = _grad(logprobs, old, advantages, mask, agg=agg, clip_ratio_c=3.0)

    global_counts = {"num_tokens": int(mask.sum()), "num_sequences": int(mask.any(-1).sum())}
    total, grads, metrics = 0.0, [], []
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        loss, grad, micro_metrics = _grad(
            logprobs[rows], old[rows], advantages[rows], mask[rows], agg=agg, clip_ratio_c=3.0, **global_counts
        )
        total += loss.item()
        grads.append(grad)
        metrics.append(micro_metrics)
    assert total == pytest.approx(full_loss.item(), rel=1e-5)
    assert torch.allclose(torch.cat(grads), full_grad, atol=1e-7)

    merged = merge_micro_batch_metrics(metrics)
    assert merged.keys() == full_metrics.keys()
    for name, value in full_metrics.items():
        assert merged[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_micro_batches_without_global_count_differ():
    """The local normalizer alone is not the batch loss: this is why the trainer passes num_tokens."""
    logprobs, old, advantages, mask = _random_batch(2)
    full, _ = policy_loss(logprobs, old, advantages, mask)
    halves = (slice(0, 3), slice(3, 6))
    split = sum(policy_loss(logprobs[rows], old[rows], advantages[rows], mask[rows])[0] for rows in halves)
    assert split.item() != pytest.approx(full.item(), rel=1e-3)


def test_metrics_values():
    old = torch.zeros(2, 4)
    ratios = torch.tensor([[1.5, 1.1, 0.5, 1.0], [0.5, 1.5, 0.9, 7.0]])
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    _, metrics = policy_loss(ratios.log(), old, advantages, mask)
    assert metrics["clipfrac_high"] == pytest.approx(1 / 7)  # 1.5 with A > 0
    assert metrics["clipfrac_low"] == pytest.approx(1 / 7)  # 0.5 with A < 0
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 1.0 + 0.5 + 1.5 + 0.9) / 7)
    assert metrics["approx_kl"] == pytest.approx(-ratios.log()[mask.bool()].mean().item())
    assert metrics["num_masked_tokens"] == 7 and metrics["num_active_sequences"] == 2
    assert all(isinstance(value, int | float) for value in metrics.values())


def test_per_token_advantages_match_broadcast():
    logprobs, old, advantages, mask = _random_batch(3)
    per_sample, _ = policy_loss(logprobs, old, advantages, mask)
    per_token, _ = policy_loss(logprobs, old, advantages.unsqueeze(-1).expand_as(logprobs), mask)
    assert per_token.item() == pytest.approx(per_sample.item())


def test_masked_positions_may_hold_nan_and_all_masked_is_zero():
    logprobs, old, advantages, mask = _random_batch(4)
    logprobs = logprobs.masked_fill(~mask, float("nan"))
    old = old.masked_fill(~mask, float("-inf"))
    loss, grad, metrics = _grad(logprobs, old, advantages, mask)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.all(grad[~mask] == 0)
    assert all(math.isfinite(value) for value in metrics.values())

    loss, grad, metrics = _grad(logprobs, old, advantages, torch.zeros_like(mask))
    assert loss.item() == 0.0 and torch.all(grad == 0) and metrics["num_masked_tokens"] == 0


def test_bf16_inputs_and_detached_old_logprobs():
    logprobs, old, advantages, mask = _random_batch(5)
    old = old.clone().requires_grad_(True)
    advantages = advantages.clone().requires_grad_(True)
    new = logprobs.to(torch.bfloat16).requires_grad_(True)
    loss, _ = policy_loss(new, old, advantages, mask)
    assert loss.dtype == torch.float32
    loss.backward()
    assert new.grad is not None and old.grad is None and advantages.grad is None


def test_bad_inputs_name_the_problem():
    logprobs, old, advantages, mask = _random_batch(6)
    with pytest.raises(ValueError, match="unknown agg"):
        policy_loss(logprobs, old, advantages, mask, agg="sum")
    with pytest.raises(ValueError, match="old_logprobs shape"):
        policy_loss(logprobs, old[:, :-1], advantages, mask)
    with pytest.raises(ValueError, match="mask shape"):
        policy_loss(logprobs, old, advantages, mask[:-1])
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logprobs, old, advantages[:-1], mask)
    with pytest.raises(ValueError, match="num_tokens"):
        policy_loss(logprobs, old, advantages, mask, num_tokens=-1)
