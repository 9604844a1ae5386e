"""Your reward function: where it is (``reward.function``), which of its forms it has, and what its answers mean.

``reward.function`` is ``"path/to/file.py:name"`` or ``"package.module:name"`` (``:name`` defaults to
``compute_score``, verl's default). Forms, told apart by the signature:

* **per sample** — verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``, called by keyword,
  so a verl reward file works unchanged;
* **a group at a time** — verl's batched names ``(data_sources, solution_strs, ground_truths, extra_infos)``: lists
  of the G responses to one prompt, returning a list of G answers;
* either form as ``async def``.

An answer is a number (the score; correct when > 0) or a mapping with ``score``, an optional ``acc`` (the
correctness dynamic sampling filters on; true or > 0 is correct; default ``score > 0``) and any other keys, of which
the numeric ones are logged as ``reward/extra/<key>``.

This module uses only the standard library: the reward's worker processes import it (:mod:`.worker`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dapo_megatron.config.reward import names_a_file, split_target

SAMPLE_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")
GROUP_PARAMETERS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


class RewardFunctionError(ValueError):
    """``reward.function`` cannot be used: not found, does not import, or has a signature of neither form."""


@dataclass(frozen=True)
class RewardForm:
    batched: bool  # a group at a time (verl's batched names)
    is_async: bool


@dataclass(frozen=True)
class RewardValue:
    """One response's reward: the score, the correctness dynamic sampling filters on, numeric extras."""

    score: float
    acc: bool
    extras: dict[str, float] = field(default_factory=dict)


def load_reward_function(target: str) -> Callable:
    """Import ``target`` and return the function it names. A file is imported as a module of its own (so pickling
    and dataclasses inside it work); a module name is imported from ``sys.path``."""
    location, name = split_target(target)
    if names_a_file(location):
        path = Path(location).resolve()
        if not path.is_file():
            raise RewardFunctionError(f"{target!r}: no such file {path}")
        module_name = f"dapo_megatron_user_reward_{zlib.crc32(str(path).encode()):08x}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # a SyntaxError, an ImportError of its own imports, anything it raises
            sys.modules.pop(module_name, None)
            raise RewardFunctionError(f"{target!r}: importing {path} failed: {type(error).__name__}: {error}"
                                      ) from error
    else:
        try:
            module = importlib.import_module(location)
        except Exception as error:
            raise RewardFunctionError(f"{target!r}: importing {location} failed: {type(error).__name__}: {error}"
                                      ) from error
    function = getattr(module, name, None)
    if function is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardFunctionError(f"{target!r}: {location} has no {name!r} (callables in it: {', '.join(public)})")
    if not callable(function):
        raise RewardFunctionError(f"{target!r}: {name!r} is a {type(function).__name__}, not a function")
    return function


def reward_form(function: Callable, target: str) -> RewardForm:
    """Which form ``function`` has, from the names its signature accepts."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as error:
        raise RewardFunctionError(f"{target!r}: its signature cannot be read: {error}") from error
    is_async = inspect.iscoroutinefunction(function)
    for names, batched in ((GROUP_PARAMETERS, True), (SAMPLE_PARAMETERS, False)):
        try:
            signature.bind(**{n: None for n in names})
        except TypeError:
            continue
        return RewardForm(batched=batched, is_async=is_async)
    raise RewardFunctionError(
        f"{target!r}: the signature {signature} takes neither verl's per-sample arguments "
        f"({', '.join(SAMPLE_PARAMETERS)}) nor its batched ones ({', '.join(GROUP_PARAMETERS)}), all by keyword")


def reward_value(raw) -> RewardValue:
    """Read one answer of a reward function (see the module docstring); raise ``TypeError``/``ValueError`` saying
    what is wrong with it."""
    if isinstance(raw, Mapping):
        if "score" not in raw:
            raise ValueError(f"returned a mapping without 'score' (keys: {sorted(raw)})")
        score = _number(raw["score"], "score")
        acc = _correct(raw["acc"]) if "acc" in raw and raw["acc"] is not None else score > 0
        extras = {str(k): float(v) for k, v in raw.items()
                  if k not in ("score", "acc") and isinstance(v, numbers.Real) and math.isfinite(float(v))}
        return RewardValue(score, acc, extras)
    score = _number(raw, "the score")
    return RewardValue(score, score > 0)


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} as {what}, expected a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"returned {number} as {what}")
    return number


def _correct(value) -> bool:
    return value if isinstance(value, bool) else _number(value, "acc") > 0


# How one response's reward came out: ("ok", RewardValue), or ("error" | "timeout", what happened).
Outcome = tuple[str, "RewardValue | str"]


def answer_outcome(raw) -> Outcome:
    """One answer as an outcome: ``ok`` with its value, or ``error`` saying what is wrong with it."""
    try:
        return ("ok", reward_value(raw))
    except (TypeError, ValueError) as error:
        return ("error", str(error))


def group_outcomes(answers, size: int, who: str) -> list[Outcome]:
    """The answers to a group of ``size`` responses (a list of as many), as outcomes; ``who`` names the answerer in
    the error of a list of another length."""
    if not isinstance(answers, (list, tuple)) or len(answers) != size:
        what = f"{len(answers)} answers" if isinstance(answers, (list, tuple)) else f"a {type(answers).__name__}"
        return [("error", f"{who} returned {what} for a group of {size}")] * size
    return [answer_outcome(answer) for answer in answers]
