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
  dropout the dropped copy of the input (``in/T`` for a row-parallel linear or a column-parallel one under sequence
  parallelism, whose input is a rank's tokens; ``in`` otherwise), plus with Transformer Engine's fused norm + linear
  (``linear_qkv``, ``linear_fc1``) the adapter's own normalized input (``h``, ``h/T`` under sequence parallelism)
  and, unless the model is fp32, the float32 copy of the input its RMSNorm computes in (as much again at 4 bytes a
  value); the adapter's ``A x`` reads the input the base linear already keeps. Under full recomputation a layer
  keeps only its input between passes (counted by :mod:`.gpu`), so the adapters add one layer's activations, for the
  layer being recomputed.

Measured against the objects on CPU: ``python bench/lora_memory.py``.
"""

from __future__ import annotations

import dataclasses

from dapo_megatron.config.model import LoRAConfig, Precision, Recompute
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
                                        sequence_parallel: bool, transformer_engine: bool,
                                        precision: Precision) -> float:
    """Values (in the activation dtype) one layer's adapters keep per token for backward (see the module
    docstring)."""
    float32_copy = 0.0 if precision == "fp32" else 2.0  # 4 bytes a value, in 2-byte activation values
    column_input_share = 1 / tensor_parallel if sequence_parallel else 1.0
    values = 0.0
    for name, (n_in, _, copies) in linear_shapes(spec).items():
        if name not in lora.target_modules:
            continue
        routed = spec.moe.topk if spec.moe is not None and name in ("linear_fc1", "linear_fc2") else 1
        values += routed * lora.rank
        if lora.dropout:
            values += routed * n_in * (column_input_share if name in COLUMN else 1 / tensor_parallel)
        if transformer_engine and name in FUSED_NORM and routed == 1:
            values += spec.hidden_size * column_input_share * (1.0 + float32_copy)
    return values


def with_lora(stages: list[StageMemory], spec: ModelSpec, lora: LoRAConfig, *, tensor_parallel: int,
              data_parallel: int, expert_parallel: int, precision: Precision, distributed_optimizer: bool,
              micro_batch_tokens: int, transformer_engine: bool, recompute: Recompute,
              sequence_parallel: bool) -> list[StageMemory]:
    """The stages of :func:`~dapo_megatron.policy.memory.gpu.estimate_memory` (same layout and precision) with the base
    frozen and ``lora``'s adapters trained (see the module docstring)."""
    weight_bytes = act_bytes = 4 if precision == "fp32" else 2
    optimizer_per_param = (8 + (0 if precision == "fp32" else 4)) / (data_parallel if distributed_optimizer else 1)
    expert_optimizer_per_param = optimizer_per_param * (expert_parallel if distributed_optimizer else 1)
    dense, experts = adapter_parameters_per_gpu(spec, lora, tensor_parallel=tensor_parallel,
                                                expert_parallel=expert_parallel)
    per_token = adapter_activation_values_per_token(spec, lora, tensor_parallel=tensor_parallel,
                                                    sequence_parallel=sequence_parallel,
                                                    transformer_engine=transformer_engine, precision=precision)
    result = []
    for stage in stages:
        dense_here, experts_here = stage.layers * dense, stage.layers * experts
        adapters = dense_here + experts_here
        layers_kept = 1 if recompute == "full" else stage.micro_batches_in_flight * stage.layers
        activations = stage.activations_bytes + int(layers_kept * per_token * micro_batch_tokens * act_bytes)
        result.append(dataclasses.replace(
            stage, parameters=stage.parameters + adapters, frozen_parameters=stage.parameters,
            expert_parameters=experts_here, params_bytes=stage.params_bytes + adapters * weight_bytes,
            grads_bytes=adapters * 4,
            optimizer_bytes=int(dense_here * optimizer_per_param + experts_here * expert_optimizer_per_param),
            activations_bytes=activations,
            margin_bytes=int(FIXED_MARGIN_BYTES + FRAGMENTATION * (activations + stage.logits_bytes))))
    return result
