"""``reward:``: what scores a response (the built-in DAPO math rule, a function of yours or a reward service) and
the optional format bonus."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from dapo_megatron.config.errors import ConfigError, require, require_finite_numbers


DEFAULT_FUNCTION_NAME = "compute_score"


def split_target(target: str) -> tuple[str, str]:
    """``"a/b.py:name"`` → (``"a/b.py"``, ``"name"``); the name defaults to ``compute_score``."""
    location, _, name = target.rpartition(":") if ":" in target else (target, "", DEFAULT_FUNCTION_NAME)
    if not location or not name:
        raise ConfigError(f"{target!r} is not 'path/to/file.py:name' or 'package.module:name'")
    return location, name


def names_a_file(location: str) -> bool:
    """Whether a target's location is a file (else a module name to import)."""
    return location.endswith(".py") or "/" in location or "\\" in location


def check_source_compiles(target: str, key: str) -> None:
    """A function file that does not compile, named with its line, while the config loads: before anything slow is
    imported (a file that does not exist is left to the loader, which says so)."""
    location, _ = split_target(target)
    path = Path(location)
    if not names_a_file(location) or not path.is_file():
        return
    try:
        compile(path.read_bytes(), str(path.resolve()), "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as error:  # ValueError: a null byte in the source
        where = f", line {error.lineno}" if getattr(error, "lineno", None) else ""
        message = getattr(error, "msg", None) or str(error)
        raise ConfigError(f"{key}: {target!r}: {path.resolve()}{where}: {type(error).__name__}: {message}") from None


@dataclass
class FormatRewardConfig:
    """Soft format enforcement: a bonus ``weight(step)`` for a response that matches ``pattern``, where weight falls
    linearly from ``weight`` at step 0 to 0 at ``decay_steps``. Added to the score the advantages use, never to the
    correctness dynamic sampling filters on. Off (weight 0) by default, as in the paper's recipe."""

    weight: float = 0.0
    decay_steps: int = 100
    pattern: str = r"(?im)^[ \t]*Answer[ \t]*:[ \t]*\S"  # a line starting with "Answer:" and an answer

    def validate(self) -> None:
        """Called by :meth:`RewardConfig.validate`, which also checks that the numbers are finite."""
        require(self.weight >= 0, "reward.format.weight", f"must be >= 0, got {self.weight}")
        require(self.decay_steps >= 1, "reward.format.decay_steps", f"must be >= 1, got {self.decay_steps}")
        try:
            re.compile(self.pattern)
        except re.error as error:
            raise ConfigError(f"reward.format.pattern: not a regular expression: {error}") from None


@dataclass
class RewardConfig:
    """What scores a response (dapo_megatron/reward/). Default: the built-in DAPO math rule (+1 / -1)."""

    # Your reward: "path/to/file.py:name" or "package.module:name" (name defaults to compute_score), with verl's
    # signature compute_score(data_source, solution_str, ground_truth, extra_info) -> float | {"score", "acc", ...};
    # a group at a time with verl's batched names (data_sources, solution_strs, ground_truths, extra_infos); or async.
    function: str | None = None
    url: str | None = None  # a reward service: POST of a group in verl's batched names, a JSON list back
    num_workers: int = 4  # worker processes for `function` (concurrent HTTP requests for `url`)
    # The built-in rule in those worker processes too, not in trainer rank 0, whose GIL it would hold while rank 0
    # launches kernels every other rank waits on (the GPU examples turn it on; a CPU run needs no extra processes).
    builtin_in_workers: bool = False
    async_concurrency: int = 16  # an async function: calls in flight per worker process
    timeout_s: float = 60.0  # per call: a sample, or a group for the batched form / a url request
    error_score: float = -1.0  # the score of a sample whose reward raised or timed out (counted, never correct)
    url_retries: int = 3  # a failed url request is retried this many times, with backoff
    # The run stops with a reward error (exit 8) when more than this fraction of the responses scored together (at
    # least 32) failed: a reward that fails on every response trains nothing. 1.0: never stop.
    max_error_fraction: float = 0.5
    format: FormatRewardConfig = field(default_factory=FormatRewardConfig)

    def validate(self) -> None:
        require_finite_numbers(self, "reward.")
        require(not (self.function and self.url), "reward.url", "and reward.function are two rewards: give one")
        require(not (self.builtin_in_workers and (self.function or self.url)), "reward.builtin_in_workers",
                "moves the built-in rule; with reward.function or reward.url there is none to move")
        require(self.num_workers >= 1, "reward.num_workers", f"must be >= 1, got {self.num_workers}")
        require(self.async_concurrency >= 1, "reward.async_concurrency", f"must be >= 1, got {self.async_concurrency}")
        require(self.timeout_s > 0, "reward.timeout_s", f"must be > 0, got {self.timeout_s}")
        if self.function:
            check_source_compiles(self.function, "reward.function")
        require(self.url_retries >= 0, "reward.url_retries", f"must be >= 0, got {self.url_retries}")
        self.format.validate()
