"""The ablation ladder's run directories → two markdown tables and one PNG. Pure: it only reads ``metrics.jsonl``.

Per rung, over its seeds (mean ± sample standard deviation):

* held-out accuracy at chosen steps, the best point of the seed-mean curve, and the final accuracy's difference to
  rung 0 (naive GRPO) in standard errors of that difference;
* sample efficiency against a target — rung 0's final mean accuracy: the first evaluated step at which the rung's
  seed-mean accuracy reaches it, and the training samples generated up to that step (dynamic sampling generates
  more per step, so the two can disagree);
* generated samples per step (and × rung 0), mean response length and fraction of truncated responses over the
  run (overlong filtering and the soft punishment only act on long responses), entropy at the last step, the
  fraction of generated groups dynamic sampling filtered out, the fraction with no learning signal at all (every
  response right or every response wrong — counted with or without dynamic sampling) and training seconds per step.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ACC_PREFIX = "val/all/acc/mean@"  # greedy held-out accuracy (mean@1) in the tiny configs
SAMPLES = "rollout/num_samples"  # responses generated for training this step (every generation round)
KEPT = "train/filter/kept_fraction"
ALL_CORRECT = "train/filter/all_correct_fraction"
ALL_WRONG = "train/filter/all_wrong_fraction"
LENGTH = "response_length/mean"
TRUNCATED = "response_length/clip_ratio"  # responses cut at max_response_length (what overlong shaping acts on)
ENTROPY = "actor/entropy"
CLIPFRAC = "actor/pg_clipfrac"  # tokens whose ratio the objective clipped (upper + lower bound)
CLIPFRAC_HIGH = "actor/pg_clipfrac_high"  # the upper bound alone: what Clip-Higher moves
STEP_SECONDS = "timing_s/step"
# The per-step quantities drawn per rung in the dynamics figure, with their axis labels.
DYNAMICS = {ENTROPY: "entropy (actor/entropy)", LENGTH: "response length (tokens)",
            TRUNCATED: "truncated fraction (response_length/clip_ratio)",
            CLIPFRAC: "clipped tokens (actor/pg_clipfrac)"}
START_STEPS = 5  # "at the start": the first training steps


def read_rows(metrics_file: Path) -> list[dict]:
    """One row per step, in step order. A step logged twice keeps its last row: a run resumed before its first
    checkpoint starts over and logs its first steps again."""
    by_step: dict[int, dict] = {}
    for number, line in enumerate(Path(metrics_file).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{metrics_file}:{number}: not a JSON line ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{metrics_file}:{number}: a metrics row needs an integer 'step'")
        by_step[row["step"]] = row
    return [by_step[step] for step in sorted(by_step)]


def _number(value) -> float | None:
    """A logged scalar, or None for a missing or non-finite one (the writer logs inf/nan as strings)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


@dataclass
class SeedRun:
    """One rung at one seed: its metrics rows."""

    seed: int
    rows: list[dict]

    def accuracy(self) -> dict[int, float]:
        """Held-out accuracy by evaluated step."""
        curve = {}
        for row in self.rows:
            keys = sorted(k for k in row if k.startswith(ACC_PREFIX))
            if keys and _number(row[keys[0]]) is not None:
                curve[row["step"]] = _number(row[keys[0]])
        return curve

    def training_rows(self) -> list[dict]:
        return [row for row in self.rows if row["step"] > 0]

    def cumulative_samples(self) -> dict[int, float]:
        """Training samples generated up to and including each step (step 0: none)."""
        total, out = 0.0, {0: 0.0}
        for row in self.training_rows():
            total += _number(row.get(SAMPLES)) or 0.0
            out[row["step"]] = total
        return out

    def mean_over_steps(self, key: str, weight_key: str | None = None) -> float | None:
        pairs = [(_number(row.get(key)), _number(row.get(weight_key)) if weight_key else 1.0)
                 for row in self.training_rows()]
        pairs = [(value, weight) for value, weight in pairs if value is not None and weight]
        total = sum(weight for _, weight in pairs)
        return sum(value * weight for value, weight in pairs) / total if total else None

    def no_signal_fraction(self) -> float | None:
        """All-correct + all-wrong groups over every group generated, weighted by what each step generated."""
        rows = [r for r in self.training_rows() if _number(r.get(ALL_CORRECT)) is not None
                and _number(r.get(ALL_WRONG)) is not None and _number(r.get(SAMPLES))]
        total = sum(_number(r[SAMPLES]) for r in rows)
        return sum((_number(r[ALL_CORRECT]) + _number(r[ALL_WRONG])) * _number(r[SAMPLES]) for r in rows) / total \
            if total else None

    def curve(self, key: str) -> dict[int, float]:
        """``key`` by training step (steps where it is missing or non-finite left out)."""
        return {row["step"]: v for row in self.training_rows() if (v := _number(row.get(key))) is not None}

    def mean_of_steps(self, key: str, *, first: int | None = None, last_fraction: float | None = None) -> float | None:
        """Mean of ``key`` over the first ``first`` training steps, or over the last ``last_fraction`` of them."""
        values = list(self.curve(key).values())
        if first is not None:
            values = values[:first]
        if last_fraction is not None:
            values = values[-max(1, round(len(values) * last_fraction)):] if values else values
        return statistics.fmean(values) if values else None

    def last(self, key: str) -> float | None:
        values = [_number(row.get(key)) for row in self.training_rows()]
        values = [v for v in values if v is not None]
        return values[-1] if values else None


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation over seeds (std is None for a single seed)."""

    mean: float
    std: float | None
    n: int

    @property
    def se(self) -> float | None:
        """The standard error of the mean: std / sqrt(n)."""
        return self.std / math.sqrt(self.n) if self.std is not None else None

    def format(self, spec: str = ".3f", spread: str = "std") -> str:
        """``mean ± spread`` with ``spread`` "std" or "se" (the mean alone for one seed)."""
        text = format(self.mean, spec)
        value = {"std": self.std, "se": self.se}[spread]
        return f"{text} ± {format(value, spec)}" if value is not None else text


def stat(values: Sequence[float | None]) -> Stat | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return Stat(statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else None, len(present))


def first_reaching(curve: dict[int, float], target: float) -> int | None:
    """The first step (in step order) whose value reaches ``target``; None if none does."""
    return next((step for step in sorted(curve) if curve[step] >= target - 1e-12), None)


@dataclass
class RungSummary:
    name: str
    seeds: list[int]
    acc: dict[int, Stat]  # by step evaluated in every seed's run
    samples_at: dict[int, float]  # mean over seeds of the samples generated up to each of those steps
    samples_per_step: Stat | None
    response_length: Stat | None
    truncated: Stat | None
    entropy_end: Stat | None
    filtered: Stat | None
    no_signal: Stat | None
    step_seconds: Stat | None
    truncated_start: Stat | None = None  # over the first START_STEPS training steps
    entropy_start: Stat | None = None
    entropy_late: Stat | None = None  # over the last quarter of the run: less noisy than one step
    length_late: Stat | None = None
    clipfrac: Stat | None = None
    clipfrac_high: Stat | None = None
    dynamics: dict[str, dict[int, Stat]] | None = None  # DYNAMICS' keys by step, over the seeds logging the step

    @property
    def mean_curve(self) -> dict[int, float]:
        return {step: s.mean for step, s in self.acc.items()}

    @property
    def final(self) -> Stat:
        return self.acc[max(self.acc)]

    def best(self) -> tuple[float, int]:
        """The highest point of the seed-mean curve (less biased by noise than averaging each seed's maximum)."""
        step = max(self.acc, key=lambda s: (self.acc[s].mean, -s))
        return self.acc[step].mean, step


def summarize_rung(name: str, runs: Sequence[SeedRun]) -> RungSummary:
    if not runs:
        raise ValueError(f"rung {name}: no runs to summarize")
    curves = [run.accuracy() for run in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    if not steps:
        raise ValueError(f"rung {name}: its runs share no evaluated step (seeds {[r.seed for r in runs]})")
    cumulative = [run.cumulative_samples() for run in runs]
    return RungSummary(
        name=name,
        seeds=[run.seed for run in runs],
        acc={step: stat([c[step] for c in curves]) for step in steps},
        samples_at={step: statistics.fmean(c.get(step, math.nan) for c in cumulative) for step in steps},
        samples_per_step=stat([run.mean_over_steps(SAMPLES) for run in runs]),
        response_length=stat([run.mean_over_steps(LENGTH) for run in runs]),
        truncated=stat([run.mean_over_steps(TRUNCATED) for run in runs]),
        entropy_end=stat([run.last(ENTROPY) for run in runs]),
        filtered=stat([None if (kept := run.mean_over_steps(KEPT, SAMPLES)) is None else 1.0 - kept for run in runs]),
        no_signal=stat([run.no_signal_fraction() for run in runs]),
        step_seconds=stat([run.mean_over_steps(STEP_SECONDS) for run in runs]),
        truncated_start=stat([run.mean_of_steps(TRUNCATED, first=START_STEPS) for run in runs]),
        entropy_start=stat([run.mean_of_steps(ENTROPY, first=START_STEPS) for run in runs]),
        entropy_late=stat([run.mean_of_steps(ENTROPY, last_fraction=0.25) for run in runs]),
        length_late=stat([run.mean_of_steps(LENGTH, last_fraction=0.25) for run in runs]),
        clipfrac=stat([run.mean_over_steps(CLIPFRAC) for run in runs]),
        clipfrac_high=stat([run.mean_over_steps(CLIPFRAC_HIGH) for run in runs]),
        dynamics={key: _by_step([run.curve(key) for run in runs]) for key in DYNAMICS},
    )


def _by_step(curves: Sequence[dict[int, float]]) -> dict[int, Stat]:
    steps = sorted(set().union(*curves))
    return {step: stat([c.get(step) for c in curves]) for step in steps}


def step_zero_spread(runs: Sequence[SeedRun]) -> float | None:
    """Max − min step-0 accuracy over ``runs``. Every run starts from the same model and greedy evaluation is
    deterministic, so anything but 0 means the runs did not start from the same weights."""
    values = [run.accuracy()[0] for run in runs if 0 in run.accuracy()]
    return max(values) - min(values) if values else None


def default_table_steps(steps: int, eval_every: int) -> list[int]:
    """0, ⅓, ⅔ and all of ``steps``, each moved to the nearest evaluated step (0/20/40/60 for 60 steps)."""
    evaluated = sorted({0, steps, *range(eval_every, steps, eval_every)} if eval_every else {0, steps})
    wanted = [0, steps / 3, 2 * steps / 3, steps]
    return sorted({min(evaluated, key=lambda s: (abs(s - w), s)) for w in wanted})


def _cell(value, spec: str = ".3f") -> str:
    if value is None:
        return "—"
    return value.format(spec) if isinstance(value, Stat) else format(value, spec)


def _difference(rung: Stat, baseline: Stat) -> str:
    diff = rung.mean - baseline.mean
    if rung.std is None or baseline.std is None:
        return f"{diff:+.3f}"
    standard_error = math.sqrt(rung.std**2 / rung.n + baseline.std**2 / baseline.n)
    return f"{diff:+.3f} ({diff / standard_error:+.1f} SE)" if standard_error > 0 else f"{diff:+.3f}"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def format_tables(summaries: Sequence[RungSummary], table_steps: Sequence[int],
                  baseline: RungSummary | None) -> str:
    """The accuracy table and the efficiency/dynamics table, as markdown. ``baseline`` is rung 0 (or None when it
    was not run: then the columns measured against it are left out)."""
    target = baseline.final.mean if baseline else None
    accuracy_header = ["rung", "seeds", *[f"acc @{s}" for s in table_steps], "best (step)"]
    if baseline:
        accuracy_header.append("final − rung 0")
    accuracy_rows = []
    for s in summaries:
        best, best_step = s.best()
        row = [s.name, str(len(s.seeds)), *[_cell(s.acc.get(step)) for step in table_steps],
               f"{best:.3f} ({best_step})"]
        if baseline:
            row.append(_difference(s.final, baseline.final) if s is not baseline else "—")
        accuracy_rows.append(row)

    efficiency_header = ["rung"]
    if baseline:
        efficiency_header += [f"steps to {target:.3f}", f"samples to {target:.3f}"]
    efficiency_header += ["samples/step", "response length", "truncated", "entropy (end)", "groups filtered",
                          "groups w/o signal", "s/step"]
    base_rate = baseline.samples_per_step.mean if baseline and baseline.samples_per_step else None
    efficiency_rows = []
    for s in summaries:
        row = [s.name]
        if baseline:
            reached = first_reaching(s.mean_curve, target)
            row += ["not reached" if reached is None else str(reached),
                    "—" if reached is None else f"{s.samples_at[reached]:,.0f}"]
        rate = _cell(s.samples_per_step, ".0f")
        if base_rate and s.samples_per_step:
            rate += f" (×{s.samples_per_step.mean / base_rate:.2f})"
        row += [rate, _cell(s.response_length, ".1f"), _cell(s.truncated), _cell(s.entropy_end),
                _cell(s.filtered, ".2f"), _cell(s.no_signal, ".2f"), _cell(s.step_seconds, ".1f")]
        efficiency_rows.append(row)
    return _markdown(accuracy_header, accuracy_rows) + "\n\n" + _markdown(efficiency_header, efficiency_rows)


def plot_curves(summaries: Sequence[RungSummary], out: Path, target: float | None = None) -> Path:
    """Held-out accuracy per training step and per generated training sample: seed mean, band ± one std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_sample) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for s in summaries:
        steps = sorted(s.acc)
        mean = [s.acc[t].mean for t in steps]
        std = [s.acc[t].std or 0.0 for t in steps]
        for ax, xs in ((by_step, steps), (by_sample, [s.samples_at[t] for t in steps])):
            (line,) = ax.plot(xs, mean, marker="o", markersize=3, label=f"{s.name} ({len(s.seeds)} seeds)")
            ax.fill_between(xs, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                            color=line.get_color(), alpha=0.15, linewidth=0)
    for ax, label in ((by_step, "training step"), (by_sample, "generated training samples")):
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="rung 0 final mean")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    by_step.set_ylabel("held-out accuracy (mean ± std over seeds)")
    by_step.legend(fontsize=8)
    fig.suptitle("DAPO ablation ladder")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

