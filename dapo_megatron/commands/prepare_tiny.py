"""``dapo-megatron prepare-tiny``: the CPU demo's model (``model.source = tiny``) as an HF folder, by default where
``train`` looks for it (``<run_dir>/initial_model``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dapo_megatron.config import DAPOConfig
from dapo_megatron.launch_env import LaunchError, launch_env
from dapo_megatron.run.lock import RunLock
from dapo_megatron.run.model_source import tiny_model_dir
from dapo_megatron.tiny_model import prepare_tiny_model


def run(args: argparse.Namespace, config: DAPOConfig) -> int:
    if launch_env().world_size > 1:
        raise LaunchError("prepare-tiny runs as one process (not under torchrun / srun with several tasks): "
                          "`train` prepares the model on rank 0 by itself")
    if args.out is None:  # into the run directory: not while a run there may be making or reading it
        Path(config.trainer.run_dir).mkdir(parents=True, exist_ok=True)
        with RunLock(config.trainer.run_dir):
            out = prepare_tiny_model(config, tiny_model_dir(config))
    else:
        out = prepare_tiny_model(config, args.out)
    print(f"tiny model: {Path(out).resolve()}")
    return 0
