"""Atomic, resumable checkpoints.

Layout of one checkpoint (``<run_dir>/checkpoints/step_000012``)::

    model/            megatron-core distributed checkpoint of the model (loads at any TP/PP; the same format
                      checkpoint_tools.hf_to_megatron writes and checkpoint_tools.megatron_to_hf reads)
    optimizer/        distributed checkpoint of the Megatron optimizer (Adam moments, fp32 master weights)
    trainer_state.pt  step, LR-scheduler state, data-sampler position, dynamic-sampling buffer, weight version
    rng/rank_N.pt     every generator of rank N (python, numpy, torch CPU/CUDA, megatron's model-parallel tracker)
    hf/               config.json, generation_config.json and tokenizer files: what an HF export needs
    COMPLETE          written last

Every rank writes into ``step_000012.tmp``; after a barrier rank 0 writes ``COMPLETE`` and renames the folder, so a
run killed at any moment leaves either a whole checkpoint or a ``.tmp`` folder that resume ignores (and the next save
replaces). Old checkpoints beyond ``keep`` are deleted only after a newer one is complete.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    pass


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / "COMPLETE").exists():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    state["megatron_tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    torch.set_rng_state(state["torch"])  # last: on CPU the tracker shares this generator


def save_model(model_chunks: list, directory: str | Path) -> None:
    """Distributed checkpoint of the (unwrapped) model chunks; every rank calls it."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    _barrier()
    dist_checkpointing.save(model_sharded_state_dict(model_chunks), str(directory))


def model_sharded_state_dict(model_chunks: list) -> dict:
    if len(model_chunks) != 1:
        raise CheckpointError("virtual pipeline stages (several model chunks per rank) are not supported")
    module = model_chunks[0]
    module = getattr(module, "module", module)  # Megatron DDP wraps the GPTModel
    return module.sharded_state_dict()


def load_model(model_chunks: list, directory: str | Path) -> None:
    """Load a distributed model checkpoint written at any TP/PP into these chunks."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if not (directory / "metadata.json").exists():
        raise CheckpointError(f"{directory} is not a megatron-core distributed checkpoint (no metadata.json)")
    state = dist_checkpointing.load(model_sharded_state_dict(model_chunks), str(directory))
    module = model_chunks[0]
    module = getattr(module, "module", module)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"{directory}: missing tensors {missing}, unexpected tensors {list(unexpected)}")


def save_checkpoint(root: str | Path, step: int, *, model_chunks: list, optimizer, trainer_state: dict,
                    hf_files_dir: str | Path | None, keep: int) -> Path:
    """Write checkpoint ``step`` atomically (all ranks call this)."""
    from megatron.core import dist_checkpointing

    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
        (tmp / "model").mkdir()
        (tmp / "optimizer").mkdir()
    _barrier()
    model_state = model_sharded_state_dict(model_chunks)
    dist_checkpointing.save(model_state, str(tmp / "model"))
    dist_checkpointing.save(optimizer.sharded_state_dict(model_sharded_state_dict(model_chunks)),
                            str(tmp / "optimizer"))
    torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
    if _rank() == 0:
        torch.save(trainer_state, tmp / "trainer_state.pt")
        if hf_files_dir is not None:
            shutil.copytree(hf_files_dir, tmp / "hf")
    _barrier()
    if _rank() == 0:
        (tmp / "COMPLETE").write_text(f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str | Path, *, model_chunks: list, optimizer) -> dict:
    """Restore model, optimizer and this rank's RNG; return the trainer state (all ranks call this)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise CheckpointError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
    load_model(model_chunks, path / "model")
    opt_state = dist_checkpointing.load(
        optimizer.sharded_state_dict(model_sharded_state_dict(model_chunks), is_loading=True), str(path / "optimizer")
    )
    optimizer.load_state_dict(opt_state)
    rng_file = path / "rng" / f"rank_{_rank()}.pt"
    if not rng_file.exists():
        raise CheckpointError(f"{rng_file} is missing: resume with the world size the checkpoint was written with")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return torch.load(path / "trainer_state.pt", weights_only=False)
