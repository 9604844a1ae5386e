"""Synthetic integer-answer arithmetic in the DAPO-Math-17K schema, for the embedded CPU run.

Two problem kinds, the ones a ~1M-parameter model learns on a 2-core CPU with a short supervised warm-start and DAPO:
- ``chain``: 3 or 4 single-digit numbers joined by + and -, e.g. ``4+7-3``; worked left to right, one line per
  operation (``4+7=11``, ``11-3=8``).
- ``mul``: a 2-digit number times a 1-digit number, e.g. ``47*6``; worked as tens, units, sum
  (``40*6=240``, ``7*6=42``, ``240+42=282``).
Each is asked in one of three prompt templates (``47*6=``, ``What is 47*6?``, ``Compute 47*6.``); the prompt content
is only that text (no long instruction), so prompts stay a dozen tokens. Reference solutions end with
``Answer: N``. The held-out split excludes its expressions from training entirely (not only their wording).
Everything is drawn from ``random.Random(seed)``: same seed and config, same problems.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SYNTHETIC_DATA_SOURCE = "synthetic-arith"
PROMPT_TEMPLATES: dict[str, str] = {
    "bare": "{expression}=",
    "what_is": "What is {expression}?",
    "compute": "Compute {expression}.",
}
ANSWER_PREFIX = "Answer: "


@dataclass(frozen=True)
class SyntheticTaskConfig:
    """Difficulty knobs. Defaults are the task measured to be learnable on a CPU.

    ``mul_fraction``: share of multiplication problems (the rest are chains). ``chain_lengths``: numbers per chain,
    chosen uniformly. ``chain_max_digit``: chain operands are drawn from 0..chain_max_digit. ``allow_negative``:
    whether a chain may pass below zero (otherwise such chains are redrawn). ``mul_left_range`` and
    ``mul_right_range``: inclusive ranges of the two factors.
    """

    mul_fraction: float = 1.0 / 3.0
    chain_lengths: tuple[int, ...] = (3, 4)
    chain_max_digit: int = 9
    allow_negative: bool = False
    mul_left_range: tuple[int, int] = (10, 99)
    mul_right_range: tuple[int, int] = (2, 9)
    templates: tuple[str, ...] = ("bare", "what_is", "compute")

    def __post_init__(self):
        if not 0.0 <= self.mul_fraction <= 1.0:
            raise ValueError(f"mul_fraction must be in [0, 1], got {self.mul_fraction}")
        if not self.chain_lengths or min(self.chain_lengths) < 2:
            raise ValueError(f"chain_lengths must be non-empty and each >= 2, got {self.chain_lengths}")
        if not 1 <= self.chain_max_digit <= 9:
            raise ValueError(f"chain_max_digit must be a single digit in [1, 9], got {self.chain_max_digit}")
        low, high = self.mul_left_range
        if not 10 <= low <= high <= 99:
            raise ValueError(f"mul_left_range must be 2-digit bounds, got {self.mul_left_range}")
        low, high = self.mul_right_range
        if not 0 <= low <= high <= 9:
            raise ValueError(f"mul_right_range must be 1-digit bounds, got {self.mul_right_range}")
        unknown = [name for name in self.templates if name not in PROMPT_TEMPLATES]
        if not self.templates or unknown:
            known = sorted(PROMPT_TEMPLATES)
            raise ValueError(f"templates must be a non-empty subset of {known}, got {self.templates}")


@dataclass(frozen=True)
class SyntheticProblem:
    """One problem: its expression, the answer, the prompt text and the reference solution for the warm-start."""

    kind: str
    expression: str
    answer: int
    template: str
    prompt_text: str
    solution: str

    @classmethod
    def worked(cls, kind: str, expression: str, lines: list[str], answer: int, template: str) -> "SyntheticProblem":
        """A problem asked in ``template`` whose reference solution is ``lines`` then ``Answer: N``."""
        return cls(kind=kind, expression=expression, answer=answer, template=template,
                   prompt_text=PROMPT_TEMPLATES[template].format(expression=expression),
                   solution="\n".join(lines + [f"{ANSWER_PREFIX}{answer}"]))

    def to_row(self, index: int, split: str) -> dict[str, Any]:
        """The problem as a row in the DAPO-Math-17K schema."""
        return {
            "data_source": SYNTHETIC_DATA_SOURCE,
            "prompt": [{"role": "user", "content": self.prompt_text}],
            "ability": "arithmetic",
            "reward_model": {"ground_truth": str(self.answer), "style": "rule"},
            "extra_info": {"index": index, "split": split, "kind": self.kind, "expression": self.expression},
        }


@dataclass(frozen=True)
class SyntheticSplit:
    train: tuple[SyntheticProblem, ...]
    heldout: tuple[SyntheticProblem, ...]

    def train_rows(self) -> list[dict[str, Any]]:
        return [problem.to_row(i, "train") for i, problem in enumerate(self.train)]

    def heldout_rows(self) -> list[dict[str, Any]]:
        return [problem.to_row(i, "heldout") for i, problem in enumerate(self.heldout)]


def chain_solution(numbers: list[int], operators: list[str]) -> tuple[list[str], int]:
    """Working lines of a left-to-right +/- chain and its value."""
    lines = []
    value = numbers[0]
    for operator, number in zip(operators, numbers[1:]):
        result = value + number if operator == "+" else value - number
        lines.append(f"{value}{operator}{number}={result}")
        value = result
    return lines, value


def multiplication_solution(left: int, right: int) -> tuple[list[str], int]:
    """Working lines of a 2-digit x 1-digit product: tens part, units part, their sum."""
    tens, units = (left // 10) * 10, left % 10
    tens_product, units_product = tens * right, units * right
    lines = [
        f"{tens}*{right}={tens_product}",
        f"{units}*{right}={units_product}",
        f"{tens_product}+{units_product}={tens_product + units_product}",
    ]
    return lines, tens_product + units_product


def _draw_chain(rng: random.Random, config: SyntheticTaskConfig) -> tuple[str, list[str], int]:
    while True:
        length = rng.choice(config.chain_lengths)
        numbers = [rng.randint(0, config.chain_max_digit) for _ in range(length)]
        operators = [rng.choice("+-") for _ in range(length - 1)]
        lines, value = chain_solution(numbers, operators)
        running = [numbers[0]] + [int(line.rsplit("=", 1)[1]) for line in lines]
        if config.allow_negative or min(running) >= 0:
            expression = str(numbers[0]) + "".join(f"{op}{n}" for op, n in zip(operators, numbers[1:]))
            return expression, lines, value


def _draw_multiplication(rng: random.Random, config: SyntheticTaskConfig) -> tuple[str, list[str], int]:
    left = rng.randint(*config.mul_left_range)
    right = rng.randint(*config.mul_right_range)
    lines, value = multiplication_solution(left, right)
    return f"{left}*{right}", lines, value


def draw_problem(rng: random.Random, config: SyntheticTaskConfig) -> SyntheticProblem:
    """One random problem of a random kind, in a random template."""
    kind = "mul" if rng.random() < config.mul_fraction else "chain"
    draw = _draw_multiplication if kind == "mul" else _draw_chain
    expression, lines, answer = draw(rng, config)
    return SyntheticProblem.worked(kind, expression, lines, answer, rng.choice(config.templates))


def make_split(
    seed: int, n_train: int, n_heldout: int, config: SyntheticTaskConfig = SyntheticTaskConfig(),
    draw: Callable[[random.Random], SyntheticProblem] | None = None,
) -> SyntheticSplit:
    """Held-out problems with ``n_heldout`` distinct expressions, then ``n_train`` training problems whose
    expressions are never held-out ones (training may repeat an expression, in any template). ``draw``: another
    task's problem generator (e.g. :mod:`~dapo_megatron.data.synthetic_scratchpad`); by default this module's
    problems with ``config``.
    """
    task = "task" if draw else f"config: {config}"
    if draw is None:
        draw = functools.partial(draw_problem, config=config)
    if n_train < 0 or n_heldout < 0:
        raise ValueError(f"n_train and n_heldout must be >= 0, got {n_train} and {n_heldout}")
    rng = random.Random(seed)
    max_draws = 100 * (n_train + n_heldout) + 10_000
    draws = 0
    heldout: list[SyntheticProblem] = []
    heldout_expressions: set[str] = set()
    while len(heldout) < n_heldout:
        draws += 1
        if draws > max_draws:
            raise ValueError(
                f"found only {len(heldout)} distinct expressions in {max_draws} draws; n_heldout={n_heldout} is too "
                f"many for this {task}"
            )
        problem = draw(rng)
        if problem.expression not in heldout_expressions:
            heldout_expressions.add(problem.expression)
            heldout.append(problem)
    train: list[SyntheticProblem] = []
    while len(train) < n_train:
        draws += 1
        if draws > max_draws:
            raise ValueError(f"held-out expressions cover almost every problem of this {task}")
        problem = draw(rng)
        if problem.expression not in heldout_expressions:
            train.append(problem)
    return SyntheticSplit(train=tuple(train), heldout=tuple(heldout))
