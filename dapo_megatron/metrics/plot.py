"""``dapo-megatron plot RUN``: the curves the paper watches to judge a run (its "training dynamics" section) —
response length, reward, entropy, generation probability and the emergence of reflection
(``response/reflection_rate``) — and the accuracy, training and validation."""

from __future__ import annotations

from pathlib import Path

from dapo_megatron.metrics.writer import METRICS_FILE, read_metrics
from dapo_megatron.user_errors import DataError

PANELS = (
    ("response length", ("response_length/mean", "response_length/max")),
    ("reward", ("critic/score/mean",)),
    ("entropy", ("actor/entropy",)),
    ("generation probability", ("rollout/gen_prob/mean",)),
    ("reflection rate", ("response/reflection_rate",)),
    ("accuracy", ("rollout/acc/mean", "val/all/acc/mean@")),
)


def panel_series(rows: list[dict]) -> dict[str, list[tuple[str, list[tuple[int, float]]]]]:
    """Each panel's curves in ``rows`` (metrics.jsonl): title → [(metric, [(step, value), ...])]."""
    panels = {}
    for title, prefixes in PANELS:
        keys = sorted({k for row in rows for k in row if any(k.startswith(p) for p in prefixes)})
        curves = [(key, [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))])
                  for key in keys]
        panels[title] = [(key, points) for key, points in curves if points]
    return panels


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = Path(run_dir) / METRICS_FILE
    if not metrics.is_file():
        what = "no such directory" if not Path(run_dir).exists() else f"no {METRICS_FILE} in it"
        raise DataError(f"plot {run_dir}: {what} (the run directory of a `dapo-megatron train` run has one once it "
                        f"has logged its first step)")
    rows = read_metrics(run_dir)
    if not rows:
        raise DataError(f"plot {run_dir}: {metrics} has no metrics rows yet")
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for ax, (title, curves) in zip(axes.flat, panel_series(rows).items()):
        for key, points in curves:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if curves:
            ax.legend(fontsize=7)
    fig.suptitle(str(Path(run_dir).resolve().name))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
