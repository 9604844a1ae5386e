"""The RL objective of a run, picked by name from the ``algorithm`` section: the policy loss
(``algorithm.policy_loss``) and the advantage estimator (``algorithm.advantage_estimator``).

Each registry entry is a builder from the :class:`~dapo_megatron.config.AlgorithmConfig` to a function with every
setting bound, so the policy runs a loss it is given and knows nothing of ε or aggregation. A new objective is one
entry here (and its test); its settings and their defaults live in the schema only.

Policy losses — ``loss(logprobs, old_logprobs, advantages, mask, *, num_tokens, num_sequences) -> (loss, metrics)``
(:class:`PolicyLoss`), the aggregation ``algorithm.loss_agg`` bound:

    "dapo"        decoupled clip (Clip-Higher) per token, optional dual clip — :func:`.loss.policy_loss`
                  with ``algorithm.eps_low / eps_high / clip_ratio_c``

Every loss returns the metrics of :mod:`dapo_megatron.algorithm.loss`; the step's log shows them under verl's names
(:mod:`dapo_megatron.metrics.step`).

Advantage estimators — ``estimate(rewards[num_groups, G]) -> advantages[num_groups, G]``:

    "grpo"        group-normalized (R − mean) / (std + ``algorithm.advantage_eps``) —
                  :func:`.advantages.group_advantages`
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from dapo_megatron.algorithm.advantages import group_advantages
from dapo_megatron.algorithm.loss import policy_loss
from dapo_megatron.config import ConfigError

if TYPE_CHECKING:
    from dapo_megatron.config import AlgorithmConfig


class PolicyLoss(Protocol):
    """A policy loss with its settings bound (see the module docstring)."""

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                 num_tokens: int | Tensor | None, num_sequences: int | Tensor | None
                 ) -> tuple[Tensor, dict[str, float]]: ...


AdvantageEstimator = Callable[[Tensor], Tensor]


def _dapo(a: "AlgorithmConfig") -> PolicyLoss:
    return partial(policy_loss, eps_low=a.eps_low, eps_high=a.eps_high, clip_ratio_c=a.clip_ratio_c, agg=a.loss_agg)


POLICY_LOSSES: dict[str, Callable[["AlgorithmConfig"], PolicyLoss]] = {
    "dapo": _dapo,
}

ADVANTAGE_ESTIMATORS: dict[str, Callable[["AlgorithmConfig"], AdvantageEstimator]] = {
    "grpo": lambda a: partial(group_advantages, eps=a.advantage_eps),
}


def _entry(registry: dict, name: str, key: str):
    if name not in registry:
        raise ConfigError(f"algorithm.{key}: unknown {key} {name!r}; registered: {', '.join(sorted(registry))}")
    return registry[name]


def build_policy_loss(algorithm: "AlgorithmConfig") -> PolicyLoss:
    """The loss ``algorithm.policy_loss`` names, with its settings from ``algorithm``."""
    return _entry(POLICY_LOSSES, algorithm.policy_loss, "policy_loss")(algorithm)


def build_advantage_estimator(algorithm: "AlgorithmConfig") -> AdvantageEstimator:
    """The estimator ``algorithm.advantage_estimator`` names, with its settings from ``algorithm``."""
    return _entry(ADVANTAGE_ESTIMATORS, algorithm.advantage_estimator, "advantage_estimator")(algorithm)


def check_names(algorithm: "AlgorithmConfig") -> None:
    """Config validation: both names are registered (a :class:`ConfigError` listing the registered ones if not)."""
    _entry(POLICY_LOSSES, algorithm.policy_loss, "policy_loss")
    _entry(ADVANTAGE_ESTIMATORS, algorithm.advantage_estimator, "advantage_estimator")
