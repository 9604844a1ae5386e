"""Sharded safetensors + ``model.safetensors.index.json``, written by every pipeline stage in parallel, one tensor
at a time.

Every name, shape and dtype a stage exports is known before any weight is touched (the weight-mapping table bound
to the stage), so each output file's header can be written first and each tensor streamed into its file the moment
the exporter produces it (:func:`dapo_megatron.handoff.exporter.export_hf_buckets` with one tensor per bucket), then
dropped. A stage's source rank (TP 0 / DP 0) therefore holds, besides its share of the model, only the tensor being
written (plus the exporter's TP gather of it) — not a shard-sized buffer, and nothing is sent to rank 0. Rank 0
then gives the files HF's names (``model-0000i-of-0000n``, in stage order) and writes the index.

File format (safetensors): 8-byte little-endian header length ``N``, ``N`` bytes of JSON header (``{name: {dtype,
shape, data_offsets: [begin, end]}}`` plus ``__metadata__``, padded with spaces to a multiple of 8), then the raw
little-endian tensor bytes back to back in header order.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
_HEADER_ALIGN = 8


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class PlannedShard:
    """One output file: its temporary name and the tensors it will hold, in order."""

    file: str
    tensors: tuple[PlannedTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(tensors: Sequence[PlannedTensor], max_shard_bytes: int, stage: int) -> list[PlannedShard]:
    """Consecutive tensors grouped into files of at most ``max_shard_bytes`` (a larger tensor gets a file alone)."""
    groups: list[list[PlannedTensor]] = []
    size = 0
    for tensor in tensors:
        if not groups or size + tensor.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    return [PlannedShard(f"part-{stage:05d}-{i:05d}.safetensors", tuple(group)) for i, group in enumerate(groups)]


def _header(shard: PlannedShard) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in shard.tensors:
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{tensor.name}: dtype {tensor.dtype} cannot be written ({list(_SAFETENSORS_DTYPES)})")
        header[tensor.name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return encoded + b" " * (-len(encoded) % _HEADER_ALIGN)


def _next_tensor(named_tensors: Iterator[tuple[str, torch.Tensor]], expected: PlannedTensor) -> torch.Tensor:
    try:
        name, tensor = next(named_tensors)
    except StopIteration:
        raise RuntimeError(f"the exporter stopped before {expected.name}, which this stage's plan expects") from None
    if (name, tuple(tensor.shape), tensor.dtype) != (expected.name, expected.shape, expected.dtype):
        raise RuntimeError(f"the exporter produced {name} {list(tensor.shape)} {tensor.dtype} where the plan expects "
                           f"{expected.name} {list(expected.shape)} {expected.dtype}")
    return tensor


def write_planned_shards(shards: Sequence[PlannedShard], named_tensors: Iterable[tuple[str, torch.Tensor]],
                         directory: Path) -> None:
    """Write each planned file: its header, then every tensor as ``named_tensors`` produces it (same order)."""
    stream = iter(named_tensors)
    for shard in shards:
        header = _header(shard)
        with open(directory / shard.file, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for planned in shard.tensors:
                tensor = _next_tensor(stream, planned)
                data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))
                del tensor, data
    extra = next(stream, None)
    if extra is not None:
        raise RuntimeError(f"the exporter produced {extra[0]}, which is not in this stage's plan")


def name_shards_and_write_index(directory: Path, stages: Sequence[Sequence[PlannedShard]]) -> dict[str, str]:
    """Rename every stage's files (stage order) to ``model-0000i-of-0000n.safetensors``; write and return the map."""
    shards = [shard for stage in stages for shard in stage]
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (directory / shard.file).rename(directory / final)
        for tensor in shard.tensors:
            if tensor.name in weight_map:
                raise RuntimeError(f"tensor {tensor.name!r} was written twice ({weight_map[tensor.name]} and {final})")
            weight_map[tensor.name] = final
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return weight_map
