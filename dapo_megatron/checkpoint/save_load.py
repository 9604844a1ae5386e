"""Saving and loading checkpoints with megatron-core's distributed checkpointing (layout: :mod:`.layout`).

Every rank writes into ``step_000012.tmp``; after a barrier rank 0 writes ``COMPLETE`` and renames the folder, so a
run killed at any moment leaves either a whole checkpoint or a ``.tmp`` folder that resume ignores (and the next save
replaces). Old checkpoints beyond ``keep`` are deleted only after a newer one is complete, and only those of the run
that writes (``run_id``): a checkpoint some other run left in the folder is never deleted in favour of its own.

A save that fails for want of disk space (``ENOSPC``, ``EDQUOT``, or a short write with the filesystem out of room)
removes its ``.tmp`` folder and raises a :class:`CheckpointError` naming the folder, the space free and the space a
checkpoint of this run takes; a load that fails on the files (a shape that does not fit the model, an unreadable
shard) raises one naming the checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from torch.distributed.checkpoint.api import CheckpointException

from dapo_megatron.checkpoint import layout
from dapo_megatron.config import DAPOConfig, save_config
from dapo_megatron.hf_format.folder import copy_side_files
from dapo_megatron.hf_format.mismatch import TensorMismatch
from dapo_megatron.policy.lora.names import is_adapter_parameter
from dapo_megatron.overrides.megatron_core.checkpointing import (
    OPTIMIZER_STATE_METADATA,
    give_empty_adam_state,
    reapply_adam_steps,
    write_results_in_this_process,
    writers_die_with_their_trainer,
)
from dapo_megatron.user_errors import UserError

logger = logging.getLogger(__name__)


class CheckpointError(UserError, RuntimeError, kind="checkpoint"):
    """A path that is not a complete, loadable checkpoint for this model and world size, or a checkpoint that cannot
    be written where it should go (no space left); the message names it."""


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
    write_results_in_this_process()
    writers_die_with_their_trainer()
    dist_checkpointing.save(model_sharded_state_dict(model_chunks), str(directory))


def model_sharded_state_dict(model_chunks: list) -> dict:
    """What a checkpoint holds of the model: every parameter, or with LoRA (a frozen base) the adapters alone — the
    base is the run's HF folder, which the trainer and ``checkpoint_tools`` load before the checkpoint."""
    if len(model_chunks) != 1:
        raise CheckpointError("virtual pipeline stages (several model chunks per rank) are not supported")
    module = model_chunks[0]
    module = getattr(module, "module", module)  # Megatron DDP wraps the GPTModel
    state = module.sharded_state_dict()
    if any(is_adapter_parameter(name) for name, _ in module.named_parameters()):
        state = {key: value for key, value in state.items() if is_adapter_parameter(key)}
    return state


def load_model(model_chunks: list, directory: str | Path) -> None:
    """Load a distributed model checkpoint written at any TP/PP into these chunks."""

    directory = Path(directory)
    if not (directory / layout.DIST_CHECKPOINT_MARKER).exists():
        raise CheckpointError(f"{directory} is not a megatron-core distributed checkpoint "
                              f"(no {layout.DIST_CHECKPOINT_MARKER})")
    with _unloadable(directory, "does not fit the model, or is damaged"):
        state = dist_checkpointing.load(model_sharded_state_dict(model_chunks), str(directory))
    module = model_chunks[0]
    module = getattr(module, "module", module)
    missing, unexpected = module.load_state_dict(state, strict=False)
    lora = any(is_adapter_parameter(name) for name, _ in module.named_parameters())
    missing = [k for k in missing if not k.endswith("_extra_state") and (is_adapter_parameter(k) or not lora)]
    mismatch = TensorMismatch(missing=missing, unexpected=list(unexpected))
    if mismatch:
        raise CheckpointError(mismatch.report(f"{directory} does not fit the model"))


def save_checkpoint(root: str | Path, step: int, *, model_chunks: list, optimizer, trainer_state: dict,
                    side_files_from: str | Path | None, keep: int, run_id: str | None = None,
                    config: DAPOConfig | None = None) -> Path:
    """Write checkpoint ``step`` atomically (all ranks call this); ``hf/`` gets the side files (config, tokenizer)
    of the HF folder ``side_files_from``. ``run_id`` names the run writing it (retention keeps ``keep`` of that
    run's checkpoints and touches no other); ``config``: the run's resolved config, stored with it."""

    final = layout.step_dir(root, step)
    tmp = final.with_name(final.name + layout.TMP_SUFFIX)
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / layout.RNG_DIR).mkdir(parents=True)
        (tmp / layout.MODEL_DIR).mkdir()
        (tmp / layout.OPTIMIZER_DIR).mkdir()
    _barrier()
    write_results_in_this_process()
    writers_die_with_their_trainer()  # a trainer killed mid-save leaves no writer behind
    model_state = model_sharded_state_dict(model_chunks)
    # Before its first applied update an optimizer has no state to save (and megatron's distributed optimizer
    # cannot even describe it): its folder then holds nothing, which load_checkpoint recognizes.
    optimizer_state = {}
    if _has_stepped(optimizer):
        optimizer_state = optimizer.sharded_state_dict(model_sharded_state_dict(model_chunks),
                                                       metadata=OPTIMIZER_STATE_METADATA)
    try:
        dist_checkpointing.save(model_state, str(tmp / layout.MODEL_DIR))
        dist_checkpointing.save(optimizer_state, str(tmp / layout.OPTIMIZER_DIR))
        torch.save(rng_state(), layout.rng_file(tmp, _rank()))
        if _rank() == 0:
            torch.save(trainer_state, tmp / layout.TRAINER_STATE_FILE)
            if side_files_from is not None:
                copy_side_files(side_files_from, tmp / layout.HF_DIR)
            if config is not None:
                save_config(config, tmp / layout.CONFIG_FILE)
            if run_id is not None:
                (tmp / layout.RUN_ID_FILE).write_text(f"{run_id}\n")
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        _raise_interruption(error)
        full = _out_of_space(error, tmp, root, needed=_state_bytes(model_state) + _state_bytes(optimizer_state))
        if full is None:
            raise
        raise full from None
    _barrier()
    if _rank() == 0:
        (tmp / layout.COMPLETE_MARKER).write_text(f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _remove_old_checkpoints(root, keep=keep, run_id=run_id, newest=step)
    _barrier()
    return final


def _remove_old_checkpoints(root: str | Path, *, keep: int, run_id: str | None, newest: int) -> None:
    """Keep the ``keep`` newest checkpoints of run ``run_id`` up to step ``newest``; never touch another run's."""
    own = [path for path in layout.list_checkpoints(root)
           if layout.run_id_of(path) == run_id and layout.checkpoint_step(path) <= newest]
    others = [path.name for path in layout.list_checkpoints(root) if layout.run_id_of(path) != run_id]
    if others:
        logger.warning("%s holds checkpoints of another run (%s): retention leaves them alone", root,
                       ", ".join(others))
    for old in own[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ failures


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and what it wraps: its cause and context chain, and each rank's failure inside torch's
    CheckpointException."""
    seen, todo = set(), [error]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]


def _raise_interruption(error: BaseException) -> None:
    """Raise the KeyboardInterrupt (or other stop) inside ``error``, if any: torch's checkpoint collectives wrap
    whatever a rank raised, a Ctrl-C included, in a CheckpointException."""
    for cause in _causes(error):
        if not isinstance(cause, (Exception, CheckpointException)):
            raise cause


def _state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (sharded) state dict: what this rank writes, at least."""
    if isinstance(state, dict):
        return sum(_state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(value) for value in state)
    tensor = getattr(state, "data", state)
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _out_of_space(error: BaseException, tmp: Path, root: str | Path, *, needed: int) -> CheckpointError | None:
    """The CheckpointError to raise when ``error`` came from a full filesystem (its ``.tmp`` folder removed), else
    None. torch's zip writer reports a short write as "unexpected pos", not as ENOSPC: a filesystem with less room
    left than the checkpoint needs is taken as the cause too."""
    previous = layout.latest_checkpoint(root)
    needed = max(needed, _folder_bytes(previous) if previous is not None else 0)
    no_space = any(isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
                   for cause in _causes(error))
    shutil.rmtree(tmp, ignore_errors=True)  # what it holds is useless, and others may need the room
    free = shutil.disk_usage(tmp.parent).free
    if not no_space and free >= needed:
        return None
    return CheckpointError(f"no space left for checkpoint {tmp.name.removesuffix(layout.TMP_SUFFIX)} in {tmp.parent}: "
                           f"{free / 2**20:.1f} MiB free there, a checkpoint of this run takes about "
                           f"{needed / 2**20:.1f} MiB (the previous checkpoints are intact)")


@contextlib.contextmanager
def _unloadable(path: Path, what: str) -> Iterator[None]:
    """Turns the ways a checkpoint's files fail to load (megatron's CheckpointingException: a shape that does not
    fit; torch's CheckpointException, unreadable or damaged files) into a CheckpointError naming ``path``."""
    try:
        yield
    except (CheckpointingException, CheckpointException, OSError, EOFError, pickle.UnpicklingError) as error:
        _raise_interruption(error)
        root = [cause for cause in _causes(error) if not isinstance(cause, CheckpointException)]
        detail = (str(root[-1]) if root else type(error).__name__).strip().splitlines()[0]
        raise CheckpointError(f"{path} {what}: {detail}") from None


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
        give_empty_adam_state(optimizer)
        with _unloadable(path / layout.OPTIMIZER_DIR, "does not fit the optimizer, or is damaged"):
            opt_state = dist_checkpointing.load(
                optimizer.sharded_state_dict(model_sharded_state_dict(model_chunks), is_loading=True,
                                             metadata=OPTIMIZER_STATE_METADATA),
                str(path / layout.OPTIMIZER_DIR),
            )
        with torch.no_grad():  # fp32 training: the distributed optimizer's main params are views of model leaves
            optimizer.load_state_dict(opt_state)
            reapply_adam_steps(optimizer)
    else:
        # Written before the optimizer's first applied update: it had no state then, and this fresh one has none
        # either (loading would ask for Adam moments that were never saved). Its main copies follow the model.
        optimizer.reload_model_params()
    rng = layout.rng_file(path, _rank())
    if not rng.exists():
        raise CheckpointError(f"{rng} is missing: resume with the world size the checkpoint was written with")
    with _unloadable(path, "is damaged"):
        set_rng_state(torch.load(rng, weights_only=False))
        return torch.load(path / layout.TRAINER_STATE_FILE, weights_only=False)
