"""The ablation report's training dynamics: the per-rung table of truncation, entropy, length and clip fractions,
the curves figure (``ablation_curves.png``), and one line per technique saying whether its effect exceeds seed noise
on the quantity its paper says it acts on. Pure, like :mod:`ablation_report`: it reads the summaries (and, for the
clip setting, a run's resolved ``config.yaml``)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Sequence

import yaml
from ablation_report import CLIPFRAC, DYNAMICS, START_STEPS, RungSummary, Stat, _cell, _markdown

DYNAMICS_NOTES = f"""\
truncated: the fraction of responses cut at rollout.max_response_length, over the first {START_STEPS} training
steps and over the whole run. entropy: the policy's mean token entropy on the step's responses (actor/entropy), over
the first {START_STEPS} steps and the last quarter of the run. clipped tokens: actor/pg_clipfrac, the fraction
of loss tokens whose importance ratio the objective clipped (GSPO: whole responses; CISPO: capped weights);
upper-clipped: actor/pg_clipfrac_high, the upper bound alone (positive advantage, ratio above 1 + eps_high), the only
one Clip-Higher changes. Lengths and truncation are over the step's training batch: with dynamic sampling, after the
groups with no learning signal were dropped. In the figure the rungs with a symmetric clip (eps_high = eps_low, no
Clip-Higher) are the thick solid lines."""


def symmetric_clip(run_dir: Path) -> bool:
    """Whether the run used DAPO's loss with eps_high = eps_low (no Clip-Higher), from its resolved config.yaml."""
    try:
        algorithm = yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return False
    return algorithm.get("policy_loss", "dapo") == "dapo" and algorithm.get("eps_high") == algorithm.get("eps_low")


def plot_dynamics(summaries: Sequence[RungSummary], out: Path, *, symmetric_clip: Sequence[str] = (),
                  smooth: int = 3) -> Path:
    """Entropy, response length, truncated fraction and clipped-token fraction per training step: the seed mean
    (a centred moving average over ``smooth`` steps), band ± one std. Rungs named in ``symmetric_clip`` (no
    Clip-Higher) are drawn solid and thick, the others dashed, so the entropy curves with and without it stand
    apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9), sharex=True)
    for ax, (key, label) in zip(axes.flat, DYNAMICS.items()):
        for s in summaries:
            by_step = (s.dynamics or {}).get(key, {})
            steps = sorted(by_step)
            if not steps:
                continue
            mean = _moving_average([by_step[t].mean for t in steps], smooth)
            std = _moving_average([by_step[t].std or 0.0 for t in steps], smooth)
            symmetric = s.name in symmetric_clip
            (line,) = ax.plot(steps, mean, linestyle="-" if symmetric else "--", linewidth=2.2 if symmetric else 1.2,
                              label=f"{s.name}{' (symmetric clip)' if symmetric else ''}")
            ax.fill_between(steps, [max(0.0, m - d) for m, d in zip(mean, std)],  # all four are >= 0
                            [m + d for m, d in zip(mean, std)], color=line.get_color(), alpha=0.08, linewidth=0)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if key == CLIPFRAC:  # GSPO clips whole responses (tens of percent), DAPO a few tokens in a thousand
            ax.set_yscale("symlog", linthresh=1e-3)
    for ax in axes[1]:
        ax.set_xlabel("training step")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"DAPO ablation ladder: training dynamics (seed mean, {smooth}-step moving average, band ± std)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    half = max(window, 1) // 2
    return [statistics.fmean(values[max(0, i - half): i + half + 1]) for i in range(len(values))]


# What each technique is claimed to act on (the paper's Table 1 and section 3; GSPO's and CISPO's papers): the rung
# that adds it, the rung it is compared with, and the measured quantities, the claimed one first.
TECHNIQUES = [
    ("overlong filtering", 1, 0, "masks truncated samples out of the loss: steadier training, higher accuracy",
     ("final accuracy", "entropy (last quarter)")),
    ("Clip-Higher", 2, 1, "a higher upper clip keeps entropy from collapsing (Figure 2)",
     ("entropy (last quarter)", "final accuracy", "upper-clipped tokens")),
    ("soft overlong punishment", 3, 2, "a length penalty near the limit: fewer truncated responses, less reward noise",
     ("truncated (run mean)", "final accuracy")),
    ("token-level loss", 4, 3, "long responses weigh per token: keeps long degenerate responses from growing",
     ("response length (last quarter)", "entropy (last quarter)", "final accuracy")),
    ("dynamic sampling", 5, 4, "only groups with a learning signal: higher accuracy per step, more generation",
     ("final accuracy",)),
    ("GSPO objective", 6, 5, "a sequence-level clipped ratio instead of DAPO's token ratios", ("final accuracy",)),
    ("CISPO objective", 7, 5, "clipped detached IS weights on every token instead of DAPO's clip",
     ("final accuracy", "entropy (last quarter)")),
]
MEASURES = {
    "final accuracy": lambda s: s.final,
    "entropy (last quarter)": lambda s: s.entropy_late,
    "truncated (run mean)": lambda s: s.truncated,
    "response length (last quarter)": lambda s: s.length_late,
    "upper-clipped tokens": lambda s: s.clipfrac_high,
}
NOISE_SE = 2.0  # a difference of at least this many standard errors counts as beyond seed noise


def difference_in_se(rung: Stat, other: Stat) -> tuple[float, float | None]:
    """(rung − other, that difference in standard errors of the difference); None when no error can be formed."""
    diff = rung.mean - other.mean
    if rung.std is None or other.std is None:
        return diff, None
    error = math.sqrt(rung.std**2 / rung.n + other.std**2 / other.n)
    return diff, (diff / error if error > 0 else None)


def technique_verdicts(summaries: Sequence[RungSummary]) -> str:
    """One markdown line per technique whose two rungs were run: each measure's difference in SE units and whether
    the claimed one (the first) exceeds seed noise (|difference| >= NOISE_SE standard errors)."""
    by_index = {}
    for s in summaries:
        prefix = s.name.split("_", 1)[0]
        if prefix.isdigit():
            by_index[int(prefix)] = s
    lines = []
    for name, with_it, without, claim, measures in TECHNIQUES:
        if with_it not in by_index or without not in by_index:
            continue
        rung, other = by_index[with_it], by_index[without]
        parts, verdict = [], None
        for measure in measures:
            a, b = MEASURES[measure](rung), MEASURES[measure](other)
            if a is None or b is None:
                parts.append(f"{measure}: not logged")
                continue
            diff, se = difference_in_se(a, b)
            parts.append(f"{measure} {a.mean:.3f} vs {b.mean:.3f}, {diff:+.3f}"
                         + (f" ({se:+.1f} SE)" if se is not None else " (no SE: one seed or no spread)"))
            if verdict is None:
                verdict = ("**exceeds seed noise**" if se is not None and abs(se) >= NOISE_SE
                           else "within seed noise")
        lines.append(f"- **{name}** ({rung.name} vs {other.name}; claimed: {claim}) — {verdict or 'not measured'} "
                     f"on {measures[0]}. " + "; ".join(parts) + ".")
    return "\n".join(lines)


def format_dynamics_table(summaries: Sequence[RungSummary]) -> str:
    """Per rung: truncation at the start and over the run, entropy at the start and late, late response length and
    the clipped-token fractions — what overlong shaping, Clip-Higher and the token-level loss act on."""
    header = ["rung", f"truncated (first {START_STEPS} steps)", "truncated (run)", f"entropy (first {START_STEPS})",
              "entropy (last quarter)", "response length (last quarter)", "clipped tokens", "upper-clipped tokens"]
    rows = [[s.name, _cell(s.truncated_start), _cell(s.truncated), _cell(s.entropy_start), _cell(s.entropy_late),
             _cell(s.length_late, ".1f"), _cell(s.clipfrac, ".4f"), _cell(s.clipfrac_high, ".4f")] for s in summaries]
    return _markdown(header, rows)
