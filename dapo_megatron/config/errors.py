"""The error every configuration check raises, and the two checks each section's ``validate`` is made of."""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass

from dapo_megatron.user_errors import UserError


class ConfigError(UserError, ValueError, kind="config"):
    """A configuration key is unknown or its value is invalid; the message names the dotted key."""


def require(ok: bool, key: str, message: str) -> None:
    """Raise ``ConfigError("<key>: <message>")`` unless ``ok``; ``key`` is the full dotted key."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


def require_finite_numbers(section: object, prefix: str) -> None:
    """Every float setting of ``section`` (and of the sections inside it) is a finite number: YAML reads .inf and
    .nan as floats, and an infinite learning rate would only show as NaN weights a step later. ``prefix``: the
    section's dotted key with its trailing dot (``"rollout."``)."""
    for item in fields(section):
        value, key = getattr(section, item.name), f"{prefix}{item.name}"
        if is_dataclass(value):
            require_finite_numbers(value, f"{key}.")
        elif isinstance(value, float):
            require(math.isfinite(value), key, f"must be a finite number, got {value}")
