"""Saving and loading checkpoints with megatron-core's distributed checkpointing (layout: :mod:`.layout`).

Every rank writes into ``step_000012.tmp``; after a barrier rank 0 writes ``COMPLETE`` and renames the folder, so a
run killed at any moment leaves either a whole checkpoint or a ``.tmp`` folder that resume ignores (and the next save
replaces). Old checkpoints beyond ``keep`` are deleted only after a newer one is complete.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

from dapo_megatron.checkpoint import layout
from dapo_megatron.hf_format.folder import copy_side_files
from dapo_megatron.hf_format.mismatch import TensorMismatch
from dapo_megatron.user_errors import UserError


class CheckpointError(UserError, RuntimeError, kind="checkpoint"):
    """A path that is not a complete, loadable checkpoint for this model and world size; the message names it."""


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    state["megatron_tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    torch.set_rng_state(state["torch"])  # last: on CPU the tracker shares this generator


def save_model(model_chunks: list, directory: str | Path) -> None:
    """Distributed checkpoint of the (unwrapped) model chunks; every rank calls it."""

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

    directory = Path(directory)
    if not (directory / layout.DIST_CHECKPOINT_MARKER).exists():
        raise CheckpointError(f"{directory} is not a megatron-core distributed checkpoint "
                              f"(no {layout.DIST_CHECKPOINT_MARKER})")
    state = dist_checkpointing.load(model_sharded_state_dict(model_chunks), str(directory))
    module = model_chunks[0]
    module = getattr(module, "module", module)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    mismatch = TensorMismatch(missing=missing, unexpected=list(unexpected))
    if mismatch:
        raise CheckpointError(mismatch.report(f"{directory} does not fit the model"))


# How the distributed optimizer lays out its state in a checkpoint. megatron-core 0.16.1's default,
# "fully_sharded_model_space", builds ShardedTensors with ``flattened_range``, which its own save rejects
# ("ShardedTensor.flattened_range is not supported") as soon as DP > 1. "dp_reshardable" saves each rank's buffers
# as they are, with no communication; it reshards only over DP, and a resume already needs the world size the
# checkpoint was written with (every rank's RNG state is in it). Save and load must name the same layout.
OPTIMIZER_STATE_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def save_checkpoint(root: str | Path, step: int, *, model_chunks: list, optimizer, trainer_state: dict,
                    side_files_from: str | Path | None, keep: int) -> Path:
    """Write checkpoint ``step`` atomically (all ranks call this); ``hf/`` gets the side files (config, tokenizer)
    of the HF folder ``side_files_from``."""

    final = layout.step_dir(root, step)
    tmp = final.with_name(final.name + layout.TMP_SUFFIX)
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / layout.RNG_DIR).mkdir(parents=True)
        (tmp / layout.MODEL_DIR).mkdir()
        (tmp / layout.OPTIMIZER_DIR).mkdir()
    _barrier()
    model_state = model_sharded_state_dict(model_chunks)
    dist_checkpointing.save(model_state, str(tmp / layout.MODEL_DIR))
    # Before its first applied update an optimizer has no state to save (and megatron's distributed optimizer
    # cannot even describe it): its folder then holds nothing, which load_checkpoint recognizes.
    optimizer_state = {}
    if _has_stepped(optimizer):
        optimizer_state = optimizer.sharded_state_dict(model_sharded_state_dict(model_chunks),
                                                       metadata=OPTIMIZER_STATE_METADATA)
    dist_checkpointing.save(optimizer_state, str(tmp / layout.OPTIMIZER_DIR))
    torch.save(rng_state(), layout.rng_file(tmp, _rank()))
    if _rank() == 0:
        torch.save(trainer_state, tmp / layout.TRAINER_STATE_FILE)
        if side_files_from is not None:
            copy_side_files(side_files_from, tmp / layout.HF_DIR)
    _barrier()
    if _rank() == 0:
        (tmp / layout.COMPLETE_MARKER).write_text(f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in layout.list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _reapply_adam_steps(optimizer) -> None:
    """Set torch Adam's per-parameter ``step`` from the param groups the checkpoint restored.

    With torch's Adam (no TE/apex: the CPU path) megatron-core 0.16.1's ``DistributedOptimizer.load_state_dict``
    first sets every ``state[p]["step"]`` from the checkpoint's param groups, then
    ``load_parameter_state_from_dp_reshardable`` copies the step tensors of the pre-load sharded state dict back
    over them (``step`` is not stored per parameter), so a resumed run would continue with the wrong bias
    correction. TE/apex FusedAdam keeps the step only in the param groups, where this finds no per-parameter step.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        for group in inner.param_groups if inner is not None else []:
            for param in group["params"] if "step" in group else []:
                step = inner.state.get(param, {}).get("step")
                if isinstance(step, torch.Tensor):
                    step.fill_(group["step"])


def _has_stepped(optimizer) -> bool:
    """Whether any of the (chained) megatron optimizer's torch optimizers holds per-parameter state."""
    return any(len(getattr(chained, "optimizer", chained).state) > 0
               for chained in getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_state_saved(directory: Path) -> bool:
    """Whether the optimizer checkpoint holds any sharded state (none: written before the first applied update)."""

    return bool(load_sharded_metadata(str(directory)))


def load_checkpoint(path: str | Path, *, model_chunks: list, optimizer) -> dict:
    """Restore model, optimizer and this rank's RNG; return the trainer state (all ranks call this)."""

    path = Path(path)
    if not (path / layout.COMPLETE_MARKER).exists():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {layout.COMPLETE_MARKER} marker)")
    load_model(model_chunks, path / layout.MODEL_DIR)
    if _optimizer_state_saved(path / layout.OPTIMIZER_DIR):
        opt_state = dist_checkpointing.load(
            optimizer.sharded_state_dict(model_sharded_state_dict(model_chunks), is_loading=True,
                                         metadata=OPTIMIZER_STATE_METADATA),
            str(path / layout.OPTIMIZER_DIR),
        )
        with torch.no_grad():  # fp32 training: the distributed optimizer's main params are views of model leaves
            optimizer.load_state_dict(opt_state)
            _reapply_adam_steps(optimizer)
    else:
        # Written before the optimizer's first applied update: it had no state then, and this fresh one has none
        # either (loading would ask for Adam moments that were never saved). Its main copies follow the model.
        optimizer.reload_model_params()
    rng = layout.rng_file(path, _rank())
    if not rng.exists():
        raise CheckpointError(f"{rng} is missing: resume with the world size the checkpoint was written with")
    set_rng_state(torch.load(rng, weights_only=False))
    return torch.load(path / layout.TRAINER_STATE_FILE, weights_only=False)
