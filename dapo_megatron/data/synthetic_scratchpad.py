"""The scratchpad task (``data.synthetic.mode: scratchpad``): problems whose worked solution grows with the problem,
so that responses range from a dozen tokens to more than a length limit can hold.

A problem is a left-to-right chain of ``k`` single-digit numbers joined by + and -, with ``k`` drawn uniformly from
``[min_terms, max_terms]``, e.g. ``7+2-5+3``. The reference solution writes one line per partial result (``7+2=9``,
``9-5=4``, ``4+3=7``) and ends with ``Answer: 7``: about six tokens per term, so a 2-term problem is answered in
~11 tokens and a 12-term one needs ~71. With ``rollout.max_response_length`` between the two, the longest problems
cannot be finished and their (possibly correct) working is cut off unrewarded — the truncated samples that DAPO's
overlong filtering and soft punishment act on, and the long responses a token-level loss weighs more.

The running value stays a single digit (after a + the number is drawn from 0..9-value, after a - from 0..value), so
every line is single-digit arithmetic the tiny model learns quickly (a first version whose running value reached two
digits was at 2% validation accuracy after 160 warm-start steps, this one at 15.5%); difficulty comes from the
number of lines, not from the numbers.
Prompts use the default task's templates (:data:`~dapo_megatron.data.synthetic.PROMPT_TEMPLATES`) and the split is
:func:`~dapo_megatron.data.synthetic.make_split`'s: held-out expressions never appear in training, same seed same
problems.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from dapo_megatron.data.synthetic import (
    PROMPT_TEMPLATES,
    SyntheticProblem,
    SyntheticSplit,
    chain_solution,
    make_split,
)

SCRATCHPAD_KIND = "scratchpad"
MAX_DIGIT = 9


@dataclass(frozen=True)
class ScratchpadTaskConfig:
    """``min_terms``..``max_terms``: how many numbers a chain has (uniform, inclusive)."""

    min_terms: int = 2
    max_terms: int = 12
    templates: tuple[str, ...] = tuple(PROMPT_TEMPLATES)

    def __post_init__(self):
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"min_terms and max_terms need 2 <= min_terms <= max_terms, got {self.min_terms} and "
                             f"{self.max_terms}")
        unknown = [name for name in self.templates if name not in PROMPT_TEMPLATES]
        if not self.templates or unknown:
            raise ValueError(f"templates must be a non-empty subset of {sorted(PROMPT_TEMPLATES)}, got "
                             f"{self.templates}")


def draw_scratchpad_problem(rng: random.Random, config: ScratchpadTaskConfig) -> SyntheticProblem:
    terms = rng.randint(config.min_terms, config.max_terms)
    numbers = [rng.randint(0, MAX_DIGIT)]
    operators = []
    value = numbers[0]
    for _ in range(terms - 1):
        operator = rng.choice("+-")
        number = rng.randint(0, MAX_DIGIT - value) if operator == "+" else rng.randint(0, value)
        value = value + number if operator == "+" else value - number
        numbers.append(number)
        operators.append(operator)
    lines, answer = chain_solution(numbers, operators)
    expression = str(numbers[0]) + "".join(f"{op}{n}" for op, n in zip(operators, numbers[1:]))
    return SyntheticProblem.worked(SCRATCHPAD_KIND, expression, lines, answer, rng.choice(config.templates))


def make_scratchpad_split(seed: int, n_train: int, n_heldout: int,
                          config: ScratchpadTaskConfig = ScratchpadTaskConfig()) -> SyntheticSplit:
    return make_split(seed, n_train, n_heldout, draw=functools.partial(draw_scratchpad_problem, config=config))
