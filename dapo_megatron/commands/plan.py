"""``dapo-megatron plan``: the training ranks' GPU memory per pipeline stage for a config; exit 1 when a stage does
not fit (:mod:`dapo_megatron.policy.memory`)."""

from __future__ import annotations

import argparse

from dapo_megatron.config import DAPOConfig
from dapo_megatron.policy.plan_report import plan_report
from dapo_megatron.run.model_source import model_spec_for_plan


def run(args: argparse.Namespace, config: DAPOConfig) -> int:
    spec, origin = model_spec_for_plan(config)
    report, fits = plan_report(config, spec, origin, data_parallel=args.data_parallel,
                               gpu_memory_gb=args.gpu_memory_gb, local_spec=args.local_spec)
    print(report)
    return 0 if fits else 1
