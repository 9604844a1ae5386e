"""The folder layout of a checkpoint, the one place it is spelled out (no megatron here).

One trainer checkpoint (``<run_dir>/checkpoints/step_000012``)::

    model/            megatron-core distributed checkpoint of the model (loads at any TP/PP; the same format
                      checkpoint_tools.hf_to_megatron writes and checkpoint_tools.megatron_to_hf reads); with LoRA
                      of the adapters alone (the frozen base is the run's HF folder; checkpoint_tools.lora_export)
    optimizer/        distributed checkpoint of the Megatron optimizer (Adam moments, fp32 master weights; holds no
                      tensors when written before the first applied update)
    trainer_state.pt  step, LR-scheduler state, data-sampler position, dynamic-sampling buffer, weight version
    rng/rank_N.pt     every generator of rank N (python, numpy, torch CPU/CUDA, megatron's model-parallel tracker)
    hf/               config.json, generation_config.json and tokenizer files: what an HF export needs
    config.yaml       the run's resolved config when this checkpoint was written (what ``--resume`` compares with)
    run_id            the run that wrote it: retention deletes only checkpoints of its own run
    COMPLETE          written last

It is written as ``step_000012.tmp`` and renamed once ``COMPLETE`` is in it. ``checkpoint_tools.hf_to_megatron``
writes only ``model/`` and ``hf/``.
"""

from __future__ import annotations

import re
from pathlib import Path

MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
HF_DIR = "hf"
RNG_DIR = "rng"
TRAINER_STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
RUN_ID_FILE = "run_id"
COMPLETE_MARKER = "COMPLETE"
TMP_SUFFIX = ".tmp"
DIST_CHECKPOINT_MARKER = "metadata.json"  # written by megatron's dist_checkpointing next to torch DCP's .metadata

_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / RNG_DIR / f"rank_{rank}.pt"


def checkpoint_step(checkpoint: Path) -> int:
    """The step of a ``step_000012`` folder."""
    match = _STEP_DIR.match(checkpoint.name)
    if match is None:
        raise ValueError(f"{checkpoint} is not named like a trainer checkpoint (step_NNNNNN)")
    return int(match.group(1))


def run_id_of(checkpoint: Path) -> str | None:
    """The run that wrote ``checkpoint`` (None: written before checkpoints named their run)."""
    try:
        return (checkpoint / RUN_ID_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / COMPLETE_MARKER).exists():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def is_incomplete_checkpoint(folder: Path) -> bool:
    """A trainer checkpoint whose writing did not finish (a ``.tmp`` folder, or no ``COMPLETE`` marker)."""
    looks_like_trainer = (folder / TRAINER_STATE_FILE).exists() or (folder / OPTIMIZER_DIR).is_dir()
    return folder.name.endswith(TMP_SUFFIX) or (looks_like_trainer and not (folder / COMPLETE_MARKER).exists())


def missing_checkpoint_files(checkpoint: Path, world_size: int) -> list[str]:
    """What a complete trainer checkpoint that ``world_size`` ranks can resume from lacks (relative paths; empty when
    nothing is missing). Only names are checked: a file's contents are for the loader."""
    required = [f"{MODEL_DIR}/{DIST_CHECKPOINT_MARKER}", f"{OPTIMIZER_DIR}/{DIST_CHECKPOINT_MARKER}",
                TRAINER_STATE_FILE, *(f"{RNG_DIR}/rank_{rank}.pt" for rank in range(world_size))]
    return [name for name in required if not (checkpoint / name).is_file()]
