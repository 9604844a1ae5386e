"""Whether a complete-marked checkpoint can really be resumed from, without loading its tensors.

A checkpoint can be marked ``COMPLETE`` and still be damaged afterwards: a copy that missed files, a shard truncated
by a full disk or a broken transfer, a lost ``.metadata``. :func:`checkpoint_problems` finds these from file names
and sizes alone: torch's ``.metadata`` of each distributed checkpoint records, for every stored item, the file,
offset and length it was written to, so a shard shorter than its last item is truncated. ``--resume`` then takes the
newest checkpoint without problems (:func:`newest_sound_checkpoint`) and says which newer ones it passed over.
Garbage of the right size is found only once loaded (:func:`non_finite_weights`, :func:`non_finite_optimizer_state`:
the weights, and the optimizer's moments and main copies): the trainer then sets the checkpoint aside the same way and
loads the one before it.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import torch

from dapo_megatron.checkpoint import layout
from dapo_megatron.checkpoint.save_load import CheckpointError

logger = logging.getLogger(__name__)

DAMAGED_SUFFIX = ".damaged"

TORCH_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a distributed checkpoint
MEGATRON_COMMON = "common.pt"  # megatron-core's non-sharded part of a distributed checkpoint


def distributed_checkpoint_problems(directory: Path, name: str) -> list[str]:
    """What is missing or truncated in the megatron-core distributed checkpoint ``directory`` (``name``: how the
    messages call it, e.g. ``model/``)."""
    missing = [f"{name}{file}" for file in (layout.DIST_CHECKPOINT_MARKER, MEGATRON_COMMON, TORCH_METADATA)
               if not (directory / file).is_file()]
    if missing:
        return [f"lacks {', '.join(missing)}"]
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(directory)).read_metadata().storage_data or {}
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as error:
        return [f"{name}{TORCH_METADATA} is unreadable ({type(error).__name__}: {error})"]
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for file, size in sorted(needed.items()):
        path = directory / file
        if not path.is_file():
            problems.append(f"lacks {name}{file}")
        elif path.stat().st_size < size:
            problems.append(f"{name}{file} is truncated ({path.stat().st_size} bytes; {TORCH_METADATA} records "
                            f"{size})")
    return problems


def checkpoint_problems(checkpoint: Path, world_size: int) -> list[str]:
    """Why ``world_size`` ranks could not resume from the trainer checkpoint ``checkpoint`` (empty: nothing found)."""
    missing = layout.missing_checkpoint_files(checkpoint, world_size)
    if missing:
        hint = " (written by a different number of ranks?)" if any("rng/" in m for m in missing) else ""
        return [f"lacks {', '.join(missing)}{hint}"]
    problems = []
    for part in (layout.MODEL_DIR, layout.OPTIMIZER_DIR):
        problems += distributed_checkpoint_problems(checkpoint / part, f"{part}/")
    try:
        torch.load(checkpoint / layout.TRAINER_STATE_FILE, weights_only=False)
    except Exception as error:  # noqa: BLE001 - any way a pickle can fail is a damaged file here
        problems.append(f"{layout.TRAINER_STATE_FILE} is unreadable ({type(error).__name__}: {error})")
    return problems


def newest_sound_checkpoint(root: Path, world_size: int) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """The newest complete checkpoint under ``root`` without :func:`checkpoint_problems` (None: there is none), and
    the newer ones passed over, each with its problems (newest first)."""
    passed_over = []
    for path in reversed(layout.list_checkpoints(root)):
        problems = checkpoint_problems(path, world_size)
        if not problems:
            return path, passed_over
        passed_over.append((path, problems))
    return None, passed_over


def no_sound_checkpoint_error(passed_over: list[tuple[Path, list[str]]]) -> CheckpointError:
    newest, problems = passed_over[0]
    older = f"; the {len(passed_over) - 1} older ones are damaged too" if len(passed_over) > 1 else ""
    return CheckpointError(f"--resume: {newest} is marked complete but {'; '.join(problems)}{older}, so there is "
                           f"no checkpoint to resume from")


def checkpoint_to_resume(root: Path, world_size: int) -> Path | None:
    """:func:`newest_sound_checkpoint`, with every newer, damaged one renamed ``step_NNNNNN.damaged`` (kept, out of
    resume's and retention's way) and a warning; a CheckpointError when every complete checkpoint is damaged."""
    path, passed_over = newest_sound_checkpoint(root, world_size)
    if path is None and passed_over:
        raise no_sound_checkpoint_error(passed_over)
    for damaged, problems in passed_over:
        set_aside(damaged, problems, instead=path)
    return path


def set_aside(damaged: Path, problems: list[str], *, instead: Path | None) -> Path:
    """Rename the damaged checkpoint ``damaged`` to ``step_NNNNNN.damaged`` (kept, out of resume's and retention's
    way), with a warning naming ``problems`` and the checkpoint resumed from ``instead`` (None: chosen next)."""
    aside, n = damaged.with_name(damaged.name + DAMAGED_SUFFIX), 1
    while aside.exists():
        n += 1
        aside = damaged.with_name(f"{damaged.name}{DAMAGED_SUFFIX}-{n}")
    damaged.rename(aside)
    logger.warning("--resume: %s is damaged (%s): resuming from %s instead; the damaged one is kept as %s",
                   damaged, "; ".join(problems), instead or "the newest complete one before it", aside.name)
    return aside


def non_finite_weights(model_chunks: list) -> list[str]:
    """The names of this rank's loaded weight tensors that hold a NaN or an infinity: what a checkpoint whose
    shards were overwritten with same-size garbage loads as (its files' sizes and structure are whole, so
    :func:`checkpoint_problems` cannot see it)."""
    names = []
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        for name, tensor in module.state_dict().items():
            if torch.is_tensor(tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                names.append(name)
    return names


def non_finite_optimizer_state(optimizer, model_chunks: list) -> list[str]:
    """What of this rank's loaded optimizer holds a NaN or an infinity — each (chained) torch optimizer's parameters
    (the fp32 main copies megatron steps, where the model is 16-bit) and its per-parameter state (Adam's moments) —
    named ``optimizer <i> param <j>[ <state key>]``: same-size garbage in ``optimizer/`` loads as that, and would turn
    the next update's weights into NaN. Tensors that are the model's own weights (an fp32 model is its own main
    copy) are :func:`non_finite_weights`' to count."""
    weights = {tensor.data_ptr() for chunk in model_chunks for tensor in getattr(chunk, "module", chunk).parameters()}
    names = []
    for index, chained in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = getattr(chained, "optimizer", chained)
        params = [param for group in inner.param_groups for param in group["params"]]
        for number, param in enumerate(params):
            tensors = {f" {key}": value for key, value in inner.state.get(param, {}).items()}
            if param.data_ptr() not in weights:
                tensors[""] = param
            for key, tensor in tensors.items():
                if torch.is_tensor(tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    names.append(f"optimizer {index} param {number}{key}")
    return names
