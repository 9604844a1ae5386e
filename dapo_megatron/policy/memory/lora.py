"""LoRA's terms in ``dapo-megatron plan`` (:mod:`.gpu`): :func:`with_lora` turns the per-stage
estimate of full training into one of LoRA training.

On one GPU of a stage, with ``r`` the rank and the TP layouts of :mod:`dapo_megatron.policy.lora.adapter`:

* the base stays, frozen, at the weights' size (2 bytes in bf16): no gradient slot, no main copy, no moments;
* the adapters of each layer: a column-parallel linear (``linear_qkv``, ``linear_fc1``; ``in`` → ``out``) holds
  ``A`` ``r·in`` (replicated) and ``B`` ``out/T·r``; a row-parallel one (``linear_proj``, ``linear_fc2``) ``A``
  ``r·in/T`` and ``B`` ``out·r`` (replicated); a mixture-of-experts layer its ``E/X`` experts' adapters whole (experts
  take adapters only without expert tensor parallelism);
* the adapters train like any parameter: weights at the weights' size, fp32 gradients (4 bytes), Adam's moments (8)
  and an fp32 main copy (4) when the weights are not fp32, divided by D with the distributed optimizer (experts' by
  D/X);
* activations, per token and adapted linear: the ``[t, r]`` product ``A x`` that ``B``'s backward reads, plus with
  dropout the dropped copy of the input (``in/T`` or ``in``), plus with Transformer Engine's fused norm + linear
  (``linear_qkv``, ``linear_fc1``) the adapter's own normalized input (``h``); the adapter's ``A x`` reads the
  input the base linear already keeps.

Measured against the objects on CPU: ``python bench/lora_memory.py``.
"""

from __future__ import annotations

import dataclasses

from dapo_megatron.config.model import LoRAConfig, Precision
from dapo_megatron.policy.lora.sizes import linear_shapes
from dapo_megatron.policy.memory.gpu import FIXED_MARGIN_BYTES, FRAGMENTATION, StageMemory
from dapo_megatron.policy.model_spec import ModelSpec

COLUMN = ("linear_qkv", "linear_fc1")
FUSED_NORM = ("linear_qkv", "linear_fc1")  # Transformer Engine fuses the layer's norms into these


def adapter_parameters_per_gpu(spec: ModelSpec, lora: LoRAConfig, *, tensor_parallel: int,
                               expert_parallel: int) -> tuple[int, int]:
    """(dense adapters, experts' adapters) of one layer held by one GPU (see the module docstring)."""
    r, dense, experts = lora.rank, 0, 0
    for name, (n_in, n_out, copies) in linear_shapes(spec).items():
        if name not in lora.target_modules:
            continue
        if spec.moe is not None and name in ("linear_fc1", "linear_fc2"):
            experts += copies // expert_parallel * r * (n_in + n_out)
        elif name in COLUMN:
            dense += r * n_in + n_out // tensor_parallel * r
        else:
            dense += r * n_in // tensor_parallel + n_out * r
    return dense, experts


def adapter_activation_values_per_token(spec: ModelSpec, lora: LoRAConfig, *, tensor_parallel: int,
                                        transformer_engine: bool) -> float:
    """Values one layer's adapters keep per token for backward (see the module docstring)."""
    values = 0.0
    for name, (n_in, _, copies) in linear_shapes(spec).items():
        if name not in lora.target_modules:
            continue
        routed = spec.moe.topk if spec.moe is not None and name in ("linear_fc1", "linear_fc2") else 1
        values += routed * lora.rank
        if lora.dropout:
            values += routed * (n_in if name in COLUMN else n_in / tensor_parallel)
        if transformer_engine and name in FUSED_NORM and routed == 1:
            values += spec.hidden_size
    return values


def with_lora(stages: list[StageMemory], spec: ModelSpec, lora: LoRAConfig, *, tensor_parallel: int,
              data_parallel: int, expert_parallel: int, precision: Precision, distributed_optimizer: bool,
              micro_batch_tokens: int, transformer_engine: bool) -> list[StageMemory]:
    """The stages of :func:`~dapo_megatron.policy.memory.gpu.estimate_memory` (same layout and precision) with the base
    frozen and ``lora``'s adapters trained (see the module docstring)."""
    weight_bytes = act_bytes = 4 if precision == "fp32" else 2
    optimizer_per_param = (8 + (0 if precision == "fp32" else 4)) / (data_parallel if distributed_optimizer else 1)
    expert_optimizer_per_param = optimizer_per_param * (expert_parallel if distributed_optimizer else 1)
    dense, experts = adapter_parameters_per_gpu(spec, lora, tensor_parallel=tensor_parallel,
                                                expert_parallel=expert_parallel)
    per_token = adapter_activation_values_per_token(spec, lora, tensor_parallel=tensor_parallel,
                                                    transformer_engine=transformer_engine)
    result = []
    for stage in stages:
        dense_here, experts_here = stage.layers * dense, stage.layers * experts
        adapters = dense_here + experts_here
        activations = stage.activations_bytes + int(stage.micro_batches_in_flight * stage.layers * per_token
                                                    * micro_batch_tokens * act_bytes)
        result.append(dataclasses.replace(
            stage, parameters=stage.parameters + adapters, frozen_parameters=stage.parameters,
            expert_parameters=experts_here, params_bytes=stage.params_bytes + adapters * weight_bytes,
            grads_bytes=adapters * 4,
            optimizer_bytes=int(dense_here * optimizer_per_param + experts_here * expert_optimizer_per_param),
            activations_bytes=activations,
            margin_bytes=int(FIXED_MARGIN_BYTES + FRAGMENTATION * (activations + stage.logits_bytes))))
    return result
