"""Hugging Face safetensors → this rank's tensor/pipeline-parallel shard of a megatron ``GPTModel``.

Each rank reads only what it holds: the tensors of its pipeline stage, and of those only its tensor-parallel slice
(``safe_open(...).get_slice``), as :mod:`dapo_megatron.policy.weight_mapping` prescribes. Works with a single
``model.safetensors`` or a sharded checkpoint with ``model.safetensors.index.json``.

Everything is checked before a parameter is touched: every megatron parameter must have a mapping and every mapped
HF tensor must exist with its expected shape; errors name the tensor, the file and both shapes.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dapo_megatron.policy.model import ModelSpec, model_spec_from_hf
from dapo_megatron.policy.weight_mapping import (
    BoundMapping,
    HFSlice,
    ShardGeometry,
    assemble_shard,
    hf_shapes,
    pipeline_layer_offset,
    slices_for_rank,
    stage_mappings,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HFCheckpointError(ValueError):
    """The HF checkpoint does not match the model: missing tensors, wrong shapes, missing files."""


def load_hf_config(model_dir: str | Path):
    """The ``transformers`` config of a local HF model folder (no hub access)."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise HFCheckpointError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    """:func:`load_hf_config` then :func:`~dapo_megatron.policy.model.model_spec_from_hf`."""
    return model_spec_from_hf(load_hf_config(model_dir))


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside megatron's DDP / Float16Module wrappers (they keep it as ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def uses_transformer_engine_names(param_names: list[str]) -> bool:
    """TE's layer spec fuses the norms into the linears (``linear_qkv.layer_norm_weight``)."""
    return any(name.endswith(".layer_norm_weight") for name in param_names)


def model_stage_mappings(model: torch.nn.Module, spec: ModelSpec) -> list[BoundMapping]:
    """The mapping table bound to the stage ``model`` is (from parallel_state, checked against the model itself)."""
    from megatron.core import parallel_state

    model = unwrap_model(model)
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    layers = list(model.decoder.layers)
    offset = pipeline_layer_offset(spec, pp_size, pp_rank)
    for local, layer in enumerate(layers):
        if layer.layer_number != offset + local + 1:  # megatron numbers layers globally from 1
            raise HFCheckpointError(
                f"stage {pp_rank}: layer {local} is megatron layer_number {layer.layer_number}, expected "
                f"{offset + local + 1} (only the even pipeline split is supported)"
            )
    names = [n for n, _ in model.named_parameters()]
    mappings = stage_mappings(spec, layer_offset=offset, num_local_layers=len(layers),
                              first_stage=model.pre_process, last_stage=model.post_process,
                              transformer_engine=uses_transformer_engine_names(names))
    mapped = {m.megatron_name for m in mappings}
    unmapped = [n for n in names if n not in mapped]
    absent = [m for m in sorted(mapped) if m not in set(names)]
    if unmapped or absent:
        raise HFCheckpointError(
            f"stage {pp_rank}: the weight mapping does not match the model: parameters without a mapping: "
            f"{unmapped}; mapped names missing from the model: {absent}"
        )
    return mappings


class SafetensorsCheckpoint:
    """Read access to a HF safetensors checkpoint folder; use as a context manager (keeps files open)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.model_dir / SINGLE_FILE).is_file():
            with safe_open(self.model_dir / SINGLE_FILE, framework="pt") as f:
                self.weight_map = {name: SINGLE_FILE for name in f.keys()}
        else:
            raise HFCheckpointError(f"{self.model_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}")
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    def _handle(self, name: str):
        file = self.weight_map[name]
        if file not in self._handles:
            path = self.model_dir / file
            if not path.is_file():
                raise HFCheckpointError(f"{path} (listed for tensor {name!r} in {INDEX_FILE}) does not exist")
            self._handles[file] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, piece: HFSlice) -> torch.Tensor:
        """The slice of one tensor (the whole tensor when ``piece.dim`` is None), reading only those bytes."""
        handle = self._handle(piece.name)
        if piece.dim is None:
            return handle.get_tensor(piece.name)
        window = slice(piece.start, piece.stop)
        return handle.get_slice(piece.name)[window] if piece.dim == 0 else handle.get_slice(piece.name)[:, window]

    def where(self, name: str) -> str:
        return str(self.model_dir / self.weight_map[name])


@dataclass(frozen=True)
class LoadStats:
    parameters_loaded: int
    elements_read: int  # HF elements read from disk by this rank (its slices only)


def check_checkpoint(ckpt: SafetensorsCheckpoint, mappings: list[BoundMapping], geometry: ShardGeometry) -> None:
    """Every mapped HF tensor exists with its expected full shape; one error naming all problems."""
    missing, wrong = [], []
    for mapping in mappings:
        for name, expected in zip(mapping.hf_names, hf_shapes(mapping, geometry), strict=True):
            if name not in ckpt.weight_map:
                missing.append(f"{name} (for {mapping.megatron_name})")
            elif ckpt.shape(name) != expected:
                wrong.append(f"{name} in {ckpt.where(name)}: shape {list(ckpt.shape(name))}, expected {list(expected)}")
    if missing or wrong:
        parts = ([f"missing tensors: {', '.join(missing)}"] if missing else []) + (
            [f"shape mismatches: {'; '.join(wrong)}"] if wrong else [])
        raise HFCheckpointError(f"checkpoint {ckpt.model_dir} does not fit the model: " + " | ".join(parts))


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, spec: ModelSpec, model_dir: str | Path) -> LoadStats:
    """Fill this rank's parameters of ``model`` (a GPTModel, possibly DDP-wrapped) from the HF folder ``model_dir``.

    Call it before building the optimizer: a mixed-precision optimizer keeps fp32 main copies of the parameters
    made at construction (otherwise call its ``reload_model_params()`` afterwards).
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    geometry = ShardGeometry(spec, parallel_state.get_tensor_model_parallel_world_size())
    mappings = model_stage_mappings(model, spec)
    params = dict(unwrap_model(model).named_parameters())
    elements = 0
    with SafetensorsCheckpoint(model_dir) as ckpt:
        check_checkpoint(ckpt, mappings, geometry)
        for mapping in mappings:
            pieces = [ckpt.read(s) for s in slices_for_rank(mapping, geometry, tp_rank)]
            elements += sum(p.numel() for p in pieces)
            shard = assemble_shard(mapping, geometry, pieces)
            param = params[mapping.megatron_name]
            if shard.shape != param.shape:
                raise HFCheckpointError(
                    f"{mapping.megatron_name}: shard built from {mapping.hf_names} has shape {list(shard.shape)}, "
                    f"the model parameter has {list(param.shape)}"
                )
            param.copy_(shard.to(dtype=param.dtype))
    return LoadStats(len(mappings), elements)
