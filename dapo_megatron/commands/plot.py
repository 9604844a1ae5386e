"""``dapo-megatron plot``: a PNG of a run's reward, accuracy, entropy and response length."""

from __future__ import annotations

import argparse

from dapo_megatron.metrics.plot import plot_run


def run(args: argparse.Namespace, config: None) -> int:
    out = plot_run(args.run_dir, args.out)
    print(f"wrote {out}")
    return 0
