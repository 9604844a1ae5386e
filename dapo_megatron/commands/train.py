"""``dapo-megatron train``: DAPO training under the run directory's lock, until the last step or a stop signal."""

from __future__ import annotations

import argparse
from pathlib import Path

from dapo_megatron.platform import destroy_distributed
from dapo_megatron.commands.process_layout import check_inputs, init_process_layout
from dapo_megatron.config import DAPOConfig
from dapo_megatron.rank_zero import run_on_rank0
from dapo_megatron.run.directory import claim_run_directory
from dapo_megatron.run.model_source import prepare_initial_model
from dapo_megatron.run.stop_signals import STOPPED_EXIT_CODE, StopSignals
from dapo_megatron.trainer.loop import DAPOTrainer


def run(args: argparse.Namespace, config: DAPOConfig) -> int:
    with StopSignals() as stop:
        layout = init_process_layout(config)
        backend = layout.backend
        lock = None
        try:
            lock = run_on_rank0(lambda: claim_run_directory(config.trainer.run_dir, resume=args.resume,
                                                            overwrite=args.overwrite),
                                what="claiming the run directory", broadcast_result=False)
            check_inputs(config, backend, resume=args.resume)
            model_dir = prepare_initial_model(config)  # model.source = tiny: rank 0 makes it (once), the others wait
            trainer = DAPOTrainer(config, model_dir, backend, resume=args.resume, stop=stop)
            try:
                result = trainer.run()
            finally:
                trainer.shutdown()
        finally:
            try:
                destroy_distributed()
            finally:
                if lock is not None:
                    lock.release()
    run_dir = Path(config.trainer.run_dir).resolve()
    if layout.rank == 0:
        if result["stopped_by"]:
            print(f"stopped by {result['stopped_by']} after step {result['steps']}; `--resume` continues from its "
                  f"checkpoint")
        else:
            line = accuracy_line(result["first_eval"], result["last_eval"])
            if line:
                print(line)
        print(f"run directory: {run_dir}")
    return STOPPED_EXIT_CODE if result["stopped_by"] else 0


def accuracy_line(first: dict, last: dict) -> str | None:
    keys = sorted(k for k in last if k.startswith("val/all/acc/mean@"))
    if not keys:
        return None
    key = keys[0]
    return f"held-out accuracy: before={first.get(key, float('nan')):.4f} after={last[key]:.4f}"
