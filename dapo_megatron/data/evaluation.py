"""avg@k, the DAPO paper's evaluation metric, as a pure function over scored samples.

For each problem p with k sampled responses scored a_{p,1..k} in [0, 1] (1 = correct):
    mean@k(p) = (1/k) * sum_j a_{p,j}            avg@k = mean over problems of mean@k(p)
    best@k(p) = max_j a_{p,j}                    pass@k = mean over problems of best@k(p)
(the paper reports avg@32 on AIME-2024). Both are reported overall and per ``data_source`` under verl's names
``val-core/<source>/acc/mean@k`` and ``val-core/<source>/acc/best@k``; best@k here is the plain empirical
best-of-k, not verl's bootstrap estimate. Every problem must have exactly k samples, otherwise the mean would
weight problems unequally.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence


class EvalProblem(Protocol):
    """What scoring needs from a problem; ``PromptRecord`` satisfies it."""

    ground_truth: str
    data_source: str
    index: str | int


@dataclass(frozen=True)
class ScoredSample:
    data_source: str
    problem_id: str | int
    accuracy: float


@dataclass(frozen=True)
class SourceAccuracy:
    num_problems: int
    mean_at_k: float
    best_at_k: float


@dataclass(frozen=True)
class AvgAtKReport:
    k: int
    overall: SourceAccuracy
    per_source: dict[str, SourceAccuracy]

    def metrics(self, prefix: str = "val-core") -> dict[str, float]:
        """Flat metric names: ``<prefix>/<source>/acc/mean@k``, ``.../acc/best@k``, and ``<prefix>/all/...``."""
        out: dict[str, float] = {}
        for source, accuracy in [("all", self.overall), *sorted(self.per_source.items())]:
            out[f"{prefix}/{source}/acc/mean@{self.k}"] = accuracy.mean_at_k
            out[f"{prefix}/{source}/acc/best@{self.k}"] = accuracy.best_at_k
        return out


def score_samples(
    problems: Sequence[EvalProblem],
    responses: Sequence[Sequence[str]],
    accuracy_fn: Callable[[str, str], float],
) -> list[ScoredSample]:
    """Score ``responses[i][j]`` (sample j of problem i) against ``problems[i].ground_truth``.

    ``accuracy_fn(response, ground_truth)`` returns 1.0 for correct and 0.0 otherwise, e.g.
    ``lambda response, truth: math_reward(response, truth).acc``.
    """
    if len(problems) != len(responses):
        raise ValueError(f"got {len(responses)} response lists for {len(problems)} problems")
    scored = []
    for problem, samples in zip(problems, responses):
        for response in samples:
            accuracy = float(accuracy_fn(response, problem.ground_truth))
            scored.append(ScoredSample(problem.data_source, problem.index, accuracy))
    return scored


def _aggregate(per_problem: list[list[float]]) -> SourceAccuracy:
    means = [sum(accuracies) / len(accuracies) for accuracies in per_problem]
    bests = [max(accuracies) for accuracies in per_problem]
    return SourceAccuracy(
        num_problems=len(per_problem), mean_at_k=sum(means) / len(means), best_at_k=sum(bests) / len(bests)
    )


def avg_at_k(samples: Sequence[ScoredSample], k: int) -> AvgAtKReport:
    """avg@k and best@k over all problems and per data source. Raises if a problem does not have exactly k samples."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if not samples:
        raise ValueError("avg_at_k needs at least one scored sample")
    by_problem: dict[tuple[str, str | int], list[float]] = defaultdict(list)
    for sample in samples:
        if not 0.0 <= sample.accuracy <= 1.0:
            raise ValueError(
                f"accuracy of problem {sample.problem_id!r} ({sample.data_source}) must be in [0, 1], "
                f"got {sample.accuracy}"
            )
        by_problem[(sample.data_source, sample.problem_id)].append(sample.accuracy)
    wrong_counts = {key: len(values) for key, values in by_problem.items() if len(values) != k}
    if wrong_counts:
        (source, problem_id), count = next(iter(wrong_counts.items()))
        raise ValueError(
            f"avg@{k} needs exactly {k} samples per problem; {len(wrong_counts)} problems differ, e.g. problem "
            f"{problem_id!r} of {source!r} has {count}"
        )
    by_source: dict[str, list[list[float]]] = defaultdict(list)
    for (source, _), accuracies in by_problem.items():
        by_source[source].append(accuracies)
    return AvgAtKReport(
        k=k,
        overall=_aggregate(list(by_problem.values())),
        per_source={source: _aggregate(problems) for source, problems in by_source.items()},
    )
