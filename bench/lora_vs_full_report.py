"""``bench/lora_vs_full.py``'s runs → its markdown report. Pure: it reads the runs' ``metrics.jsonl`` rows only.

Every run starts from the same model, so a variant's held-out gain (accuracy at the last step − at step 0) is
compared with full fine-tuning's through the ratio of the seed means, ``R = mean(LoRA gains) / mean(full gains)``,
with its standard error by the delta method over the seeds. Seed ``k`` gives every variant the same prompt order and
sampling seeds, so the two means are paired where their seeds are: the covariance of the paired gains enters the
error. A verdict against the bar (2/3) counts only beyond two standard errors, as ``bench/ablation.py`` judges a
technique against seed noise.

The dynamics table says how each variant moved the policy: ``actor/ppo_kl`` (the KL to the sampling policy per
update, the size of a step), clipped tokens, entropy, the gradient norm (clipped at ``optim.grad_clip``) and the
training accuracy of the rollouts, each averaged over a window of steps and then over seeds.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import ablation_report as report

TARGET_RATIO = 2 / 3
MAX_FRACTION = 0.10
NOISE_SE = 2.0  # a verdict needs the bar outside ±2 standard errors of the ratio
# (metric, label, format) of the dynamics table; each is averaged over the steps of every window
DYNAMICS = (("actor/ppo_kl", "KL per update (actor/ppo_kl)", ".1e"),
            ("actor/pg_clipfrac", "clipped tokens", ".4f"),
            ("actor/entropy", "entropy", ".3f"),
            ("actor/grad_norm", "grad norm", ".2f"),
            ("rollout/acc/mean", "training accuracy", ".3f"))
WINDOWS = ((1, 20), (41, 60))


def mean_se(values: Sequence[float], spec: str = ".3f") -> str:
    """``mean ± standard error`` over seeds (the sample std / sqrt(n)); "—" for no value."""
    stat = report.stat(values)
    return stat.format(spec, spread="se") if stat else "—"


@dataclass(frozen=True)
class Ratio:
    value: float
    se: float | None

    def verdict(self, target: float = TARGET_RATIO) -> str:
        if self.se is None:
            return "one seed: no verdict"
        if self.value - NOISE_SE * self.se >= target:
            return "reaches 2/3 beyond seed noise"
        if self.value + NOISE_SE * self.se < target:
            return "misses 2/3 beyond seed noise"
        return f"{'above' if self.value >= target else 'below'} 2/3, within seed noise of it"

    def format(self) -> str:
        return f"{self.value:.2f} ± {self.se:.2f}" if self.se is not None else f"{self.value:.2f}"


def gain_ratio(lora: dict[int, float], full: dict[int, float]) -> Ratio | None:
    """``mean(lora) / mean(full)`` over each one's seeds, with the delta method's standard error:
    ``Var R ≈ (Var L̄ + R² Var F̄ − 2 R Cov(L̄, F̄)) / F̄²``, where ``Cov(L̄, F̄) = n_c · cov(L, F) / (n_L n_F)``
    over the ``n_c`` seeds both have (0 with fewer than two)."""
    if not lora or not full:
        return None
    lora_mean, full_mean = statistics.fmean(lora.values()), statistics.fmean(full.values())
    if full_mean <= 0:
        return None
    ratio = lora_mean / full_mean
    if len(lora) < 2 or len(full) < 2:
        return Ratio(ratio, None)
    var_lora = statistics.variance(lora.values()) / len(lora)
    var_full = statistics.variance(full.values()) / len(full)
    common = sorted(set(lora) & set(full))
    cov = (statistics.covariance([lora[s] for s in common], [full[s] for s in common]) * len(common)
           / (len(lora) * len(full)) if len(common) >= 2 else 0.0)
    variance = (var_lora + ratio ** 2 * var_full - 2 * ratio * cov) / full_mean ** 2
    return Ratio(ratio, math.sqrt(max(variance, 0.0)))


def window_mean(run: report.SeedRun, key: str, first: int, last: int) -> float | None:
    values = [v for step, v in run.curve(key).items() if first <= step <= last]
    return statistics.fmean(values) if values else None


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(row) + " |" for row in rows)])


def comparison_table(summary: dict[str, dict[int, dict]]) -> tuple[str, list[str]]:
    """The gains table (mean ± standard error over seeds) and one verdict line per LoRA variant."""
    full_gains = {seed: row["gain"] for seed, row in summary.get("full", {}).items()}
    rows, verdicts = [], []
    for name, per_seed in summary.items():
        if not per_seed:
            continue
        values = list(per_seed.values())
        ratio = gain_ratio({s: r["gain"] for s, r in per_seed.items()}, full_gains) if name != "full" else None
        per = ", ".join(f"{r['gain_ratio']:.2f}" for r in values if "gain_ratio" in r) or "—"
        fractions = {key: [r[key] for r in values if r.get(key) is not None]
                     for key in ("lora/trainable_fraction", "lora/handoff_fraction", "handoff/bytes", "logprob_gap")}
        rows.append([name, str(len(values)), mean_se([r["acc0"] for r in values]),
                     mean_se([r["acc_end"] for r in values]), mean_se([r["gain"] for r in values]),
                     ratio.format() if ratio else "—", per,
                     mean_se(fractions["lora/trainable_fraction"], ".4f"),
                     mean_se(fractions["lora/handoff_fraction"], ".4f"),
                     mean_se(fractions["handoff/bytes"], ".0f"),
                     f"{max(fractions['logprob_gap'], default=float('nan')):.1e}",
                     mean_se([r["wall_s"] for r in values], ".0f")])
        if ratio is not None:
            small = all(v <= MAX_FRACTION for v in fractions["lora/trainable_fraction"]
                        + fractions["lora/handoff_fraction"])
            verdicts.append(f"* {name}: {ratio.format()} of full fine-tuning's gain ({ratio.verdict()}); trainable "
                            f"parameters and handoff bytes {'within' if small else 'NOT within'} 10 % of the full "
                            f"model's.")
    header = ["variant", "seeds", "acc step 0", "acc end", "gain", "gain / full's gain", "per seed",
              "trainable fraction", "handoff fraction", "handoff bytes/step", "trainer-engine log-prob gap",
              "wall s/run"]
    return _markdown(header, rows), verdicts


def accuracy_table(runs: dict[str, list[report.SeedRun]]) -> str:
    """Held-out accuracy at every evaluated step, mean ± standard error over seeds."""
    steps = sorted(set().union(*(run.accuracy() for seed_runs in runs.values() for run in seed_runs)))
    rows = []
    for name, seed_runs in runs.items():
        if seed_runs:
            rows.append([name, *(mean_se([a[step] for run in seed_runs if step in (a := run.accuracy())])
                                 for step in steps)])
    return _markdown(["variant", *(f"step {step}" for step in steps)], rows)


def dynamics_table(runs: dict[str, list[report.SeedRun]]) -> str:
    """Each dynamics metric over the first and the last steps (:data:`WINDOWS`), mean ± standard error over seeds."""
    header = ["variant", *(f"{label}, steps {first}-{last}" for _, label, _ in DYNAMICS for first, last in WINDOWS)]
    rows = []
    for name, seed_runs in runs.items():
        if not seed_runs:
            continue
        cells = []
        for key, _, spec in DYNAMICS:
            for first, last in WINDOWS:
                values = [v for run in seed_runs if (v := window_mean(run, key, first, last)) is not None]
                cells.append(mean_se(values, spec))
        rows.append([name, *cells])
    return _markdown(header, rows)


NOTES = """\
acc: greedy held-out accuracy (300 problems); every cell is a mean ± standard error over seeds (the sample standard
deviation / sqrt(seeds)). gain: acc end − acc step 0 (every run starts from the same model, so acc step 0 is one
number). gain / full's gain: the variant's mean gain over full fine-tuning's, ± its standard error (delta method,
paired by seed); per seed: the same seed's ratio. trainable fraction: trained parameters / the model's (logged
lora/trainable_fraction); handoff fraction: bytes sent to the engine per step / the full weights' bytes
(lora/handoff_fraction; full fine-tuning sends the full weights). trainer-engine log-prob gap: the largest
rollout/logprob_diff/max_abs of any step of any seed (the embedded engine's log-probs of the tokens it sampled vs the
policy's recomputed ones; with LoRA the engine merged the adapter into its weights, megatron applies it on the side).
A verdict counts only when 2/3 lies beyond two standard errors of the ratio."""


def format_report(summary: dict[str, dict[int, dict]], runs: dict[str, list[report.SeedRun]], header: str) -> str:
    gains, verdicts = comparison_table(summary)
    return "\n\n".join([header, gains, NOTES, "\n".join(verdicts),
                        "Held-out accuracy by step (mean ± standard error over seeds):", accuracy_table(runs),
                        "How each variant moved the policy (per-step metrics averaged over the steps of a window, "
                        "then mean ± standard error over seeds):", dynamics_table(runs)]) + "\n"
