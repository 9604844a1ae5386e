"""The tool task (``data.synthetic.mode: tools``): arithmetic a ~1M-parameter model cannot do in its head but can
with the python tool — the CPU demo of tool-integrated RL (``examples/tiny_cpu_tools.yaml``).

A problem multiplies two 3-digit numbers (``347*812``) or adds a third to the product (``347*812+951``); its answer
has five to seven digits. Worked in the head, that is a dozen partial products and carries, which the tiny model does
not learn in a CPU budget (measured in docs/tools-sandbox.md: it stays near 0% on held-out problems). With the tool
it only has to copy: the expression into a call, the printed result into the answer. The reference trace
(:func:`tool_trace`) is that call, the output block the rollout loop appends, and ``Answer: N``:

    ```python
    print(347*812+951)
    ```
    ```output
    282715
    ```
    Answer: 282715

and the same problem's direct solution (``SyntheticProblem.solution``) is ``Answer: 282715`` alone, for the no-tool
twin (``examples/tiny_cpu_tools_baseline.yaml``). Prompts use the default task's templates (``347*812=``,
``What is 347*812?``, ``Compute 347*812.``); the held-out split excludes its expressions from training, and the same
seed gives the same problems (as :func:`~dapo_megatron.data.synthetic.make_split`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dapo_megatron.data.synthetic import ANSWER_PREFIX, PROMPT_TEMPLATES, SyntheticProblem, SyntheticSplit

TOOL_KINDS = ("mul", "muladd")


@dataclass(frozen=True)
class ToolTaskConfig:
    """``muladd_fraction``: share of ``a*b+c`` problems (the rest ``a*b``); every number from ``number_range``."""

    muladd_fraction: float = 0.5
    number_range: tuple[int, int] = (100, 999)
    templates: tuple[str, ...] = tuple(PROMPT_TEMPLATES)

    def __post_init__(self):
        if not 0.0 <= self.muladd_fraction <= 1.0:
            raise ValueError(f"muladd_fraction must be in [0, 1], got {self.muladd_fraction}")
        low, high = self.number_range
        if not 10 <= low <= high:
            raise ValueError(f"number_range must be (low, high) with 10 <= low <= high, got {self.number_range}")
        unknown = [name for name in self.templates if name not in PROMPT_TEMPLATES]
        if not self.templates or unknown:
            raise ValueError(f"templates must be a non-empty subset of {sorted(PROMPT_TEMPLATES)}, got "
                             f"{self.templates}")


@dataclass(frozen=True)
class ToolTrace:
    """What a reference response says: the code of its call, what the tool prints, the final line."""

    code: str
    output: str
    answer_line: str


def draw_tool_problem(rng: random.Random, config: ToolTaskConfig) -> SyntheticProblem:
    low, high = config.number_range
    numbers = [rng.randint(low, high) for _ in range(3)]
    kind = "muladd" if rng.random() < config.muladd_fraction else "mul"
    expression = f"{numbers[0]}*{numbers[1]}" + (f"+{numbers[2]}" if kind == "muladd" else "")
    answer = numbers[0] * numbers[1] + (numbers[2] if kind == "muladd" else 0)
    return SyntheticProblem.worked(kind, expression, [], answer, rng.choice(config.templates))


def tool_trace(problem: SyntheticProblem) -> ToolTrace:
    """The reference trace of a tool problem: ``print(<expression>)``, the printed answer, ``Answer: N``."""
    if problem.kind not in TOOL_KINDS:
        raise ValueError(f"tool_trace: a problem of kind {problem.kind!r} is not a tool problem ({TOOL_KINDS})")
    return ToolTrace(code=f"print({problem.expression})", output=str(problem.answer),
                     answer_line=f"{ANSWER_PREFIX}{problem.answer}")


def make_tool_split(seed: int, n_train: int, n_heldout: int,
                    config: ToolTaskConfig = ToolTaskConfig()) -> SyntheticSplit:
    """``n_heldout`` problems of distinct expressions, then ``n_train`` whose expressions are never held-out ones."""
    if n_train < 0 or n_heldout < 0:
        raise ValueError(f"n_train and n_heldout must be >= 0, got {n_train} and {n_heldout}")
    rng = random.Random(seed)
    draws, max_draws = 0, 100 * (n_train + n_heldout) + 10_000
    heldout: dict[str, SyntheticProblem] = {}
    train: list[SyntheticProblem] = []
    while len(heldout) < n_heldout or len(train) < n_train:
        draws += 1
        if draws > max_draws:
            raise ValueError(f"found {len(heldout)} held-out and {len(train)} training problems in {max_draws} draws: "
                             f"{config} has too few distinct expressions for n_heldout={n_heldout}")
        problem = draw_tool_problem(rng, config)
        if len(heldout) < n_heldout:
            heldout.setdefault(problem.expression, problem)
        elif problem.expression not in heldout:
            train.append(problem)
    return SyntheticSplit(train=tuple(train), heldout=tuple(heldout.values()))
