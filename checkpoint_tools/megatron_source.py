"""The checkpoint ``megatron_to_hf`` reads: where it is, whether it is intact, and whether it fits the model.

``--ckpt`` is one of
  * a checkpoint folder holding ``model/`` (the distributed checkpoint) and ``hf/`` (config + tokenizer): a trainer
    checkpoint ``<run>/checkpoints/step_000012/`` or the output of :mod:`checkpoint_tools.hf_to_megatron`;
  * the distributed checkpoint folder itself (it holds ``metadata.json``); config from a sibling ``hf/``;
  * a folder of trainer checkpoints (``<run>/checkpoints`` or ``<run>``): the latest complete one is converted.

The checkpoint is checked without loading it (readable metadata, every data file present and long enough); then,
inside the ranks, its tensors are compared with what the model needs (:func:`check_checkpoint_fits_model`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.errors import ConversionError
from dapo_megatron.checkpoint.layout import (
    COMPLETE_MARKER,
    DIST_CHECKPOINT_MARKER,
    HF_DIR,
    MODEL_DIR,
    is_incomplete_checkpoint,
    latest_checkpoint,
)
from dapo_megatron.hf_format import CONFIG_FILE, TensorMismatch, WrongShape


@dataclass(frozen=True)
class CheckpointSource:
    """Where the weights and the side files (config, tokenizer) of a checkpoint are."""

    model_dir: Path
    side_files_dir: Path


def resolve_checkpoint(ckpt: Path, hf_config_from: Path | None) -> CheckpointSource:
    """Find the distributed checkpoint and the side files for ``--ckpt`` (see the module docstring)."""
    if not ckpt.is_dir():
        raise ConversionError(f"--ckpt {ckpt} is not a directory")
    if (ckpt / MODEL_DIR / DIST_CHECKPOINT_MARKER).is_file():
        root, model_dir, side = ckpt, ckpt / MODEL_DIR, ckpt / HF_DIR
    elif (ckpt / DIST_CHECKPOINT_MARKER).is_file():
        root, model_dir, side = ckpt.parent, ckpt, ckpt.parent / HF_DIR
    else:
        latest = latest_checkpoint(ckpt) or latest_checkpoint(ckpt / "checkpoints")
        if latest is None:
            raise ConversionError(
                f"--ckpt {ckpt} is not a checkpoint: expected {ckpt / MODEL_DIR / DIST_CHECKPOINT_MARKER} (a "
                f"trainer checkpoint step_N/ or hf_to_megatron output), {ckpt / DIST_CHECKPOINT_MARKER} (a "
                f"distributed checkpoint) or complete step_N/ checkpoints under {ckpt} or {ckpt / 'checkpoints'}"
            )
        print(f"[megatron_to_hf] converting the latest complete checkpoint {latest}", file=sys.stderr)
        root, model_dir, side = latest, latest / MODEL_DIR, latest / HF_DIR
    if is_incomplete_checkpoint(root):
        raise ConversionError(f"{root} is an incomplete trainer checkpoint (no {COMPLETE_MARKER} marker): the run "
                              f"stopped while writing it; convert a complete one")
    side = hf_config_from if hf_config_from is not None else side
    if not (side / CONFIG_FILE).is_file():
        raise ConversionError(f"no {side / CONFIG_FILE}: pass --hf-config-from with the model's Hugging Face folder")
    return CheckpointSource(model_dir, side)


def read_checkpoint_metadata(model_dir: Path):
    """torch DCP metadata of the checkpoint, after checking that every data file it points into is long enough."""
    from torch.distributed.checkpoint import FileSystemReader

    marker = json.loads((model_dir / DIST_CHECKPOINT_MARKER).read_text() or "{}")
    backend = marker.get("sharded_backend")
    if backend != "torch_dist":
        raise ConversionError(f"{model_dir} uses dist_checkpointing backend {backend!r}; only 'torch_dist' is read")
    try:
        metadata = FileSystemReader(str(model_dir)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same thing here
        problem = f"{type(exc).__name__}: {exc}"
        raise ConversionError(f"{model_dir / '.metadata'} is missing or corrupted ({problem})") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        path = model_dir / name
        if not path.is_file():
            raise ConversionError(f"{path} is missing: the checkpoint's metadata stores tensors in it")
        if path.stat().st_size < end:
            raise ConversionError(f"{path} is truncated: {path.stat().st_size} bytes, the metadata needs {end}")
    return metadata


def dominant_dtype(metadata) -> torch.dtype:
    """The dtype most stored elements have: the weights' dtype (megatron's local spec keeps norms in fp32)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    elements: dict[torch.dtype, int] = {}
    for item in metadata.state_dict_metadata.values():
        if isinstance(item, TensorStorageMetadata):
            elements[item.properties.dtype] = elements.get(item.properties.dtype, 0) + item.size.numel()
    if not elements:
        raise ConversionError("the checkpoint holds no tensors")
    return max(elements, key=elements.__getitem__)


def _sharded_tensors(item: Any) -> list:
    """The ShardedTensors / ShardedObjects of one sharded-state-dict entry (factories built into their parts)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(item, ShardedTensorFactory):
        return _sharded_tensors(item.build())
    if isinstance(item, dict):
        return [leaf for value in item.values() for leaf in _sharded_tensors(value)]
    if isinstance(item, (list, tuple)):
        return [leaf for value in item for leaf in _sharded_tensors(value)]
    return [item]


def _local_mismatches(model, metadata, vocab_size: int) -> tuple[set[str], TensorMismatch]:
    """(checkpoint keys this rank's model needs, what of it the checkpoint lacks or has mis-shaped), from the model's
    own sharded state dict.

    Vocabulary-padded tensors (``allow_shape_mismatch``: embedding, output layer) may have any number of rows at or
    above the real vocabulary size — the padding depends on the TP size the checkpoint was written at.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dapo_megatron.checkpoint import model_sharded_state_dict

    stored = metadata.state_dict_metadata
    needed: set[str] = set()
    mismatch = TensorMismatch()
    for entry in model_sharded_state_dict([model]).values():
        for leaf in _sharded_tensors(entry):
            if isinstance(leaf, ShardedObject):
                needed.add(leaf.unique_key)
                if leaf.unique_key not in stored:
                    mismatch.missing.append(leaf.unique_key)
                continue
            if not isinstance(leaf, ShardedTensor):
                continue
            needed.add(leaf.key)
            found = stored.get(leaf.key)
            if not isinstance(found, TensorStorageMetadata):
                mismatch.missing.append(leaf.key)
                continue
            have, want = list(found.size), list(leaf.global_shape)
            if leaf.allow_shape_mismatch:
                fits = have[1:] == want[1:] and have[0] >= vocab_size
                expected = f"[>={vocab_size}, {', '.join(map(str, want[1:]))}]"
            else:
                fits, expected = have == want, want
            if not fits:
                mismatch.wrong_shape.append(WrongShape(leaf.key, have, expected))
    return needed, mismatch


def check_checkpoint_fits_model(model, metadata, spec, source: CheckpointSource) -> None:
    """Every rank raises the same error listing missing, unexpected and mis-shaped tensors (by checkpoint key)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _local_mismatches(model, metadata, spec.vocab_size))
    needed = set().union(*(n for n, _ in gathered))
    wrong_shape = {w.name: w for _, m in gathered for w in m.wrong_shape}
    mismatch = TensorMismatch(
        missing=sorted({key for _, m in gathered for key in m.missing}),
        unexpected=sorted(k for k, m in metadata.state_dict_metadata.items()
                          if isinstance(m, TensorStorageMetadata) and k not in needed),
        wrong_shape=[wrong_shape[key] for key in sorted(wrong_shape)],
    )
    if mismatch:
        raise ConversionError(mismatch.report(f"checkpoint {source.model_dir} does not match "
                                              f"{source.side_files_dir / CONFIG_FILE}"))
