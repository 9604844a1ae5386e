"""The DAPO loss as the unit tests call it: the schema's settings (``AlgorithmConfig``'s defaults, the one place they
are written) unless a test names its own — ``policy_loss`` itself takes every setting explicitly."""

from __future__ import annotations

from dapo_megatron.algorithm import loss as dapo_loss
from dapo_megatron.config import AlgorithmConfig

_DEFAULTS = AlgorithmConfig()
SCHEMA_SETTINGS = dict(eps_low=_DEFAULTS.eps_low, eps_high=_DEFAULTS.eps_high, clip_ratio_c=_DEFAULTS.clip_ratio_c,
                       agg=_DEFAULTS.aggregation)
ADVANTAGE_EPS = _DEFAULTS.advantage_eps


def policy_loss(logprobs, old_logprobs, advantages, mask, **settings):
    """:func:`dapo_megatron.algorithm.loss.policy_loss` with the schema's settings, ``settings`` overriding them."""
    return dapo_loss.policy_loss(logprobs, old_logprobs, advantages, mask, **{**SCHEMA_SETTINGS, **settings})
