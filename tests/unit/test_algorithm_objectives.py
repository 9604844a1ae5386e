"""The objective registry (algorithm.policy_loss / advantage_estimator): the default is the DAPO loss and the GRPO
advantages with the schema's settings, and an unknown name is a config error listing the registered ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loss_settings import policy_loss

from dapo_megatron.algorithm import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, build_advantage_estimator, build_policy_loss
from dapo_megatron.config import AlgorithmConfig, ConfigError, load_config

torch.set_num_threads(1)
TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def value_and_grad(fn, logprobs, *args, **kwargs):
    logprobs = logprobs.clone().requires_grad_(True)
    loss = fn(logprobs, *args, **kwargs)
    loss = loss[0] if isinstance(loss, tuple) else loss
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.detach(), grad


def test_default_objective_is_the_dapo_loss_with_the_schema_settings():
    generator = torch.Generator().manual_seed(5)
    old = -torch.rand(6, 9, generator=generator, dtype=torch.float64) * 3
    logprobs = old + 0.3 * torch.randn(6, 9, generator=generator, dtype=torch.float64)
    advantages = torch.tensor([1.0, 1.0, -0.5, -1.0, 2.0, -2.0], dtype=torch.float64)
    mask = (torch.arange(9)[None] < torch.tensor([9, 4, 1, 7, 0, 5])[:, None]).to(torch.float64)
    counts = dict(num_tokens=17, num_sequences=None)
    got = value_and_grad(build_policy_loss(AlgorithmConfig()), logprobs, old, advantages, mask, **counts)
    want = value_and_grad(policy_loss, logprobs, old, advantages, mask, **counts)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    rewards = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    torch.testing.assert_close(build_advantage_estimator(AlgorithmConfig())(rewards),
                               (rewards - rewards.mean()) / (rewards.std() + AlgorithmConfig().advantage_eps))


def test_every_registered_objective_loads_and_an_unknown_one_is_a_config_error():
    assert set(POLICY_LOSSES) == {"dapo"} and set(ADVANTAGE_ESTIMATORS) == {"grpo"}
    for name in POLICY_LOSSES:
        assert load_config(TINY, [f"algorithm.policy_loss={name}"]).algorithm.policy_loss == name
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss: unknown policy_loss 'ppo'; registered: dapo"):
        load_config(TINY, ["algorithm.policy_loss=ppo"])
    with pytest.raises(ConfigError, match=r"algorithm.advantage_estimator: .*'rloo'.*registered: grpo"):
        load_config(TINY, ["algorithm.advantage_estimator=rloo"])
