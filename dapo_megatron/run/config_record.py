"""The settings a run may change when it resumes, and the record of every config it ran with.

A resumed run must be the same run: what defines its data, model, sampling, objective and optimization — the model,
every shape, the seeds, the group size, the batch sizes, the algorithm, the learning rate — cannot change, and
``--resume`` with any of them changed is refused, naming each changed key with its old and new value
(:func:`check_resume_config`). What only says how long to run, how often to save, log or validate, where servers run
or how work is split into memory is listed in :data:`MUTABLE_ON_RESUME` and may change; each start appends a row to
``<run_dir>/config_history.jsonl`` (the full config for a new run; the changes for a resumed one), and
``config.yaml`` is the config of the latest start (:func:`record_start`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from dapo_megatron.config import ConfigError, DAPOConfig, config_to_dict, save_config
from dapo_megatron.config.loading import objective_defaults_note

CONFIG_FILE = "config.yaml"
HISTORY_FILE = "config_history.jsonl"
logger = logging.getLogger(__name__)

# Dotted keys, or prefixes ending in ".", a resumed run may change. Everything else must stay as the run began.
MUTABLE_ON_RESUME = (
    "trainer.total_steps", "trainer.save_every", "trainer.keep_checkpoints", "trainer.tensorboard",
    "trainer.run_dir",  # the directory may have been moved
    "trainer.micro_batch_tokens",  # packing: how a mini-batch is cut into micro-batches, not what it holds
    "eval.",  # when and how validation samples; training never sees it
    "rollout.sglang.",  # where the servers run and how they are reached
    "rollout.handoff_bucket_mb",
    "parallel.collective_timeout_s", "parallel.slow_collective_timeout_s", "parallel.watchdog",
    "parallel.overlap_grad_reduce", "parallel.overlap_param_gather",
    "trainer.auto_resume", "trainer.max_restarts",  # how a run heals, not what it trains
    "model.recompute",
)


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def may_change_on_resume(key: str) -> bool:
    return any(key == allowed or (allowed.endswith(".") and key.startswith(allowed)) for allowed in MUTABLE_ON_RESUME)


def config_changes(previous: dict, current: DAPOConfig) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (previous value, current value)}`` for every setting that differs. A key the previous config
    does not have (written before the key existed) counts as unchanged."""
    before, now = _flat(previous), _flat(config_to_dict(current))
    return {key: (before[key], value) for key, value in now.items() if key in before and before[key] != value}


def check_resume_config(previous: dict, current: DAPOConfig, *, where: str) -> dict[str, tuple[Any, Any]]:
    """Raise a ConfigError naming every changed setting a resumed run may not change; return the allowed changes.
    ``where``: what the previous config belongs to, for the message."""
    changes = config_changes(previous, current)
    fixed = {key: change for key, change in changes.items() if not may_change_on_resume(key)}
    if fixed:
        listed = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in fixed.items())
        raise ConfigError(f"--resume: {where} was trained with other settings that cannot change mid-run: {listed} "
                          f"(start a new run for them: --overwrite, or another trainer.run_dir)")
    return changes


def read_config_file(path: str | Path) -> dict | None:
    """A saved config as a nested dict (None when there is none)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    return tree if isinstance(tree, dict) else None


def record_start(run_dir: str | Path, config: DAPOConfig, *, run_id: str | None, step: int,
                 resumed_from: Path | None) -> str:
    """Write ``config.yaml`` and append this start to ``config_history.jsonl``: a new run with its whole config, a
    run resumed from the checkpoint ``resumed_from`` with the settings it changed. Returns the run's id (``run_id``,
    or a new one when None)."""
    run_dir = Path(run_dir)
    run_id = run_id or secrets.token_hex(6)
    note = objective_defaults_note(config)
    if note:
        logger.info("%s", note)
    previous = None
    if resumed_from is not None:
        previous = read_config_file(resumed_from / CONFIG_FILE) or read_config_file(run_dir / CONFIG_FILE)
    row = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "run_id": run_id,
           "start": "new" if resumed_from is None else "resume", "step": step}
    if resumed_from is None:
        row["config"] = config_to_dict(config)
    else:
        row["changed"] = {key: [old, new] for key, (old, new) in config_changes(previous or {}, config).items()}
    with (run_dir / HISTORY_FILE).open("a") as history:
        history.write(json.dumps(row) + "\n")
    tmp = run_dir / f".{CONFIG_FILE}.tmp"
    save_config(config, tmp)
    os.replace(tmp, run_dir / CONFIG_FILE)
    return run_id
