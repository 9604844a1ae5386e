"""The RL objective of a run, picked by name from the ``algorithm`` section: the policy loss
(``algorithm.policy_loss``) and the advantage estimator (``algorithm.advantage_estimator``).

Each registry entry is a builder from the :class:`~dapo_megatron.config.AlgorithmConfig` to a function with every
setting bound, so the policy runs a loss it is given and knows nothing of ε or aggregation. A new objective is one
entry here, its name and its paper's shared settings (``OBJECTIVE_DEFAULTS``) in the schema, and its test; its
settings and their defaults live in the schema only.

Policy losses — ``loss(logprobs, old_logprobs, advantages, mask, *, num_tokens, num_sequences) -> (loss, metrics)``
(:class:`PolicyLoss`), the aggregation bound (``algorithm.loss_agg``, or where it is null the objective's own from
``OBJECTIVE_DEFAULTS`` in :mod:`dapo_megatron.config.algorithm`: token-mean for dapo and cispo, seq-mean-token-mean
for gspo and gspo_token, each its paper's):

    "dapo"        decoupled clip (Clip-Higher) per token, optional dual clip — :func:`.loss.policy_loss`
                  with ``algorithm.eps_low / eps_high / clip_ratio_c``
    "gspo"        sequence-level ratio, clipped per response — :func:`.gspo.gspo_loss`, ``algorithm.gspo.*``
    "gspo_token"  GSPO-token: the same ratio value, per-token gradients — :func:`.gspo.gspo_loss`
    "cispo"       stop-gradient clipped IS weight on every token's log-prob — :func:`.cispo.cispo_loss`,
                  ``algorithm.cispo.*``

``clip_ratio_c`` (DAPO's dual clip) is read by "dapo" only: CISPO's weight is bounded by 1 + ε_high_IS already, and
the GSPO paper defines none. Every loss returns the same metrics; the step's log shows them under verl's names
(:mod:`dapo_megatron.metrics.step`), with r = π/π_old a token's ratio and s a response's geometric-mean ratio:

``actor/pg_clipfrac_high`` — fraction of loss tokens where the upper clip is active.
    dapo: A > 0 and r > 1 + ε_high (gradient 0). gspo, gspo_token: tokens of responses with A > 0 and
    s > 1 + ε_high (the whole response's gradient 0). cispo: r > 1 + ε_high_IS, any A (the weight is cut to
    1 + ε_high_IS; the gradient is kept).
``actor/pg_clipfrac_low`` — the same for the lower clip: dapo A < 0 and r < 1 − ε_low; gspo A < 0 and
    s < 1 − ε_low; cispo r < 1 − ε_low_IS (the weight raised; never with the default ε_low_IS = 1).
``actor/pg_clipfrac`` — the sum of the two.
``actor/pg_clipfrac_lower`` — dapo: dual clip active (A < 0 and r > clip_ratio_c); 0 for the others.
``actor/ppo_kl`` — mean of log π_old − log π over the loss tokens, for every objective.
``actor/pg_loss`` — the loss minimized: dapo and gspo the clipped surrogate −J; cispo −Σ sg(ŵ)·A·log π / norm,
    which contains log π and is not on the others' scale.
``ratio_mean`` (the update's metrics, not logged per step) — the mean of r (dapo), of s (gspo), of r before
    truncation (cispo).

With the rest of the pipeline every policy loss combines as "dapo" does; none is refused. Dynamic sampling and
overlong shaping act on rewards and advantages before any loss; overlong filtering, seq-level MIS and async mode's
stale-token masking set the loss mask (GSPO's s_i is then taken over the tokens left; a response with none left is out
of the loss); token-level TIS weights enter as per-token advantages w_t·A, which multiplies each token's loss by w_t
for all of them, each loss being positively homogeneous in A (:mod:`.rollout_correction`); routing replay and the
π_old reused from the first update's forward change where the log-probs come from, not the loss.

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
from dapo_megatron.algorithm.cispo import cispo_loss
from dapo_megatron.algorithm.gspo import gspo_loss
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
    return partial(policy_loss, eps_low=a.eps_low, eps_high=a.eps_high, clip_ratio_c=a.clip_ratio_c, agg=a.aggregation)


def _gspo(a: "AlgorithmConfig", *, token_level: bool) -> PolicyLoss:
    return partial(gspo_loss, eps_low=a.gspo.eps_low, eps_high=a.gspo.eps_high, agg=a.aggregation,
                   token_level=token_level)


def _cispo(a: "AlgorithmConfig") -> PolicyLoss:
    return partial(cispo_loss, eps_low_is=a.cispo.eps_low_is, eps_high_is=a.cispo.eps_high_is, agg=a.aggregation)


POLICY_LOSSES: dict[str, Callable[["AlgorithmConfig"], PolicyLoss]] = {
    "dapo": _dapo,
    "gspo": partial(_gspo, token_level=False),
    "gspo_token": partial(_gspo, token_level=True),
    "cispo": _cispo,
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
