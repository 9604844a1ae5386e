"""``dapo-megatron eval``: avg@k of a checkpoint on the validation data, printed and optionally written as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dapo_megatron.platform import destroy_distributed
from dapo_megatron.commands.process_layout import check_inputs, init_process_layout
from dapo_megatron.config import DAPOConfig
from dapo_megatron.trainer.evaluate import evaluate_checkpoint


def run(args: argparse.Namespace, config: DAPOConfig) -> int:
    layout = init_process_layout(config)
    try:
        check_inputs(config, layout.backend, checkpoint=args.ckpt)
        metrics = evaluate_checkpoint(config, args.ckpt, layout.backend)
    finally:
        destroy_distributed()
    if layout.rank == 0:
        for key, value in sorted(metrics.items()):
            print(f"{key}: {value:.4f}")
        if args.out:
            write_json(Path(args.out), metrics)
    return 0


def write_json(path: Path, data: dict) -> None:
    """Atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
