"""Hugging Face safetensors → this rank's tensor/pipeline/expert-parallel shard of a megatron ``GPTModel``.

Each rank reads only what it holds: the tensors of its pipeline stage (of a MoE layer, its expert-parallel rank's
experts), and of those only its tensor-parallel slice,
as :mod:`dapo_megatron.policy.weight_mapping` prescribes, through :class:`dapo_megatron.hf_format.HFWeights` (a single
``model.safetensors`` or a sharded folder with its index; every file's header checked first).

Everything is checked before a parameter is touched: every megatron parameter must have a mapping and every mapped
HF tensor must exist with its expected shape; errors name the tensor, the file and both shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core import parallel_state

from dapo_megatron.hf_format import HFFormatError, HFWeights, compare_shapes, load_hf_config
from dapo_megatron.policy.lora.names import is_adapter_parameter
from dapo_megatron.policy.model_spec import ModelSpec, model_spec_from_hf
from dapo_megatron.policy.weight_mapping import (
    BoundMapping,
    ShardGeometry,
    assemble_shard,
    hf_shapes,
    pipeline_layer_offset,
    slices_for_rank,
    stage_mappings,
)


class HFCheckpointError(HFFormatError):
    """The HF checkpoint does not match the model: missing tensors, wrong shapes, unmapped parameters."""


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    """:func:`load_hf_config` then :func:`~dapo_megatron.policy.model_spec.model_spec_from_hf`."""
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
    names = [n for n, _ in model.named_parameters() if not is_adapter_parameter(n)]  # LoRA's are not the HF model's
    mappings = stage_mappings(spec, layer_offset=offset, num_local_layers=len(layers),
                              first_stage=model.pre_process, last_stage=model.post_process,
                              transformer_engine=uses_transformer_engine_names(names),
                              expert_parallel=parallel_state.get_expert_model_parallel_world_size(),
                              expert_rank=parallel_state.get_expert_model_parallel_rank())
    mapped = {m.megatron_name for m in mappings}
    unmapped = [n for n in names if n not in mapped]
    absent = [m for m in sorted(mapped) if m not in set(names)]
    if unmapped or absent:
        raise HFCheckpointError(
            f"stage {pp_rank}: the weight mapping does not match the model: parameters without a mapping: "
            f"{unmapped}; mapped names missing from the model: {absent}"
        )
    return mappings


@dataclass(frozen=True)
class LoadStats:
    parameters_loaded: int
    elements_read: int  # HF elements read from disk by this rank (its slices only)


def check_checkpoint(weights: HFWeights, mappings: list[BoundMapping], geometry: ShardGeometry) -> None:
    """Every mapped HF tensor exists with its expected full shape; one error naming all problems."""
    expected, used_by = {}, {}
    for mapping in mappings:
        for name, shape in zip(mapping.hf_names, hf_shapes(mapping, geometry), strict=True):
            expected[name], used_by[name] = shape, mapping.megatron_name
    stored = {name: tensor.shape for name, tensor in weights.tensors.items()}
    mismatch = compare_shapes(stored, expected, where=weights.where, ignore_unexpected=lambda name: True)
    mismatch.missing = [f"{name} (for {used_by[name]})" for name in mismatch.missing]
    if mismatch:
        raise HFCheckpointError(mismatch.report(f"checkpoint {weights.model_dir} does not fit the model"))


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, spec: ModelSpec, model_dir: str | Path) -> LoadStats:
    """Fill this rank's parameters of ``model`` (a GPTModel, possibly DDP-wrapped) from the HF folder ``model_dir``.

    Call it before building the optimizer: a mixed-precision optimizer keeps fp32 main copies of the parameters
    made at construction (otherwise call its ``reload_model_params()`` afterwards).
    """

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    expert_tp_rank = parallel_state.get_expert_tensor_parallel_rank()  # experts split over their own TP group
    geometry = ShardGeometry(spec, parallel_state.get_tensor_model_parallel_world_size())
    mappings = model_stage_mappings(model, spec)
    params = dict(unwrap_model(model).named_parameters())
    elements = 0
    with HFWeights(model_dir) as weights:
        check_checkpoint(weights, mappings, geometry)
        for mapping in mappings:
            pieces = [weights.read(piece.name, piece.dim, piece.start, piece.stop)
                      for piece in slices_for_rank(mapping, geometry,
                                                   tp_rank if mapping.expert is None else expert_tp_rank)]
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
