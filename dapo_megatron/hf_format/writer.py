"""The one writer of Hugging Face folders: sharded safetensors streamed one tensor at a time, HF's shard names and
index, side files, and a folder that appears whole or not at all.

* :func:`write_shard` writes one safetensors file whose layout (names, shapes, dtypes — ``meta`` tensors will do) is
  known before its first tensor: the header goes first, then each tensor is written the moment the producer yields
  it and dropped. A writer therefore holds one tensor, not a shard. The layouts come from :func:`bucketed` — over
  ``meta`` tensors when a shard is planned ahead of the weights (the checkpoint converter), or the very buckets a
  rollout engine receives (the SGLang disk transport).
* :func:`name_shards` gives the files HF's names (``model-0000i-of-0000n.safetensors``, in the order given) and
  writes ``model.safetensors.index.json``.
* Everything is written into a hidden staging folder next to the output (``.<name>.tmp-XXXX``, same filesystem) and
  renamed into place at the end (:func:`publish`), so a reader never sees a half-written folder. An existing output
  is replaced only when asked, renamed aside first and deleted only after the new folder is in place.

:func:`write_hf_folder` does all of it in one process.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from dapo_megatron.hf_format.buckets import Bucket, nbytes
from dapo_megatron.hf_format.folder import INDEX_FILE, copy_side_files
from dapo_megatron.hf_format.header import encode_safetensors_header


@dataclass(frozen=True)
class WrittenShard:
    """A safetensors file written under a temporary name, and what it holds."""

    file: str  # name inside the folder
    names: tuple[str, ...]
    nbytes: int


def _next_tensor(tensors: Iterator[tuple[str, torch.Tensor]], expected: tuple[str, torch.Tensor],
                 path: Path) -> torch.Tensor:
    planned_name, planned = expected
    try:
        name, tensor = next(tensors)
    except StopIteration:
        raise RuntimeError(f"the tensors ended before {planned_name}, which {path.name} is planned to hold") from None
    if (name, tensor.shape, tensor.dtype) != (planned_name, planned.shape, planned.dtype):
        raise RuntimeError(f"got {name} {list(tensor.shape)} {tensor.dtype} where {path.name} is planned to hold "
                           f"{planned_name} {list(planned.shape)} {planned.dtype}")
    return tensor


def write_shard(path: Path, layout: Bucket, tensors: Iterator[tuple[str, torch.Tensor]]) -> WrittenShard:
    """Write ``path``: the header of ``layout``, then the next ``len(layout)`` tensors of ``tensors`` (which must
    match the layout in order, name, shape and dtype), each written and dropped before the next is pulled."""
    with open(path, "wb") as f:
        f.write(encode_safetensors_header(layout))
        for expected in layout:
            tensor = _next_tensor(tensors, expected, path)
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(data.numpy()))
            del tensor, data
    return WrittenShard(path.name, tuple(name for name, _ in layout), sum(nbytes(t) for _, t in layout))


def name_shards(directory: Path, shards: Sequence[WrittenShard]) -> dict[str, str]:
    """Rename the shards (in this order) to ``model-0000i-of-0000n.safetensors``; write and return the weight map."""
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (directory / shard.file).rename(directory / final)
        for name in shard.names:
            if name in weight_map:
                raise RuntimeError(f"tensor {name!r} was written twice ({weight_map[name]} and {final})")
            weight_map[name] = final
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def staging_dir(out: Path) -> Path:
    """A fresh hidden folder next to ``out`` to build it in."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))


def _default_dir_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def publish(staged: Path, out: Path, *, replace: bool) -> None:
    """Rename the finished ``staged`` folder to ``out``; an existing ``out`` is an error unless ``replace``.

    Temporary folders are created private (mode 0700); the published one gets the mode a plain ``mkdir`` would.
    """
    staged.chmod(_default_dir_mode())
    if not out.exists():
        staged.rename(out)
        return
    if not replace:
        raise FileExistsError(f"{out} already exists (pass --force to replace it)")
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    staged.rename(out)
    shutil.rmtree(old)


def discard(staging: Path | None) -> None:
    """Remove a staging folder (after a failure); nothing happens when it was already published or never made."""
    if staging is not None and staging.exists():
        shutil.rmtree(staging, ignore_errors=True)


def write_hf_folder(out: str | Path, buckets: Iterable[Bucket], *, side_files_from: str | Path | None = None,
                    replace: bool = False) -> Path:
    """Write ``out`` with one shard per bucket (plus index, plus the side files of ``side_files_from``).

    Memory: the bucket being written, which the caller holds anyway.
    """
    out = Path(out)
    staging = staging_dir(out)
    try:
        shards = [write_shard(staging / f"part-{i:05d}.safetensors", bucket, iter(bucket))
                  for i, bucket in enumerate(buckets)]
        if not shards:
            raise ValueError(f"no tensors to write to {out}")
        name_shards(staging, shards)
        if side_files_from is not None:
            copy_side_files(side_files_from, staging)
        publish(staging, out, replace=replace)
    except BaseException:
        discard(staging)
        raise
    return out
