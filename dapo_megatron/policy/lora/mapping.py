"""The HF (PEFT) names and tensor-parallel splits of LoRA adapters, derived from the base weights' mapping table
(:mod:`dapo_megatron.policy.weight_mapping`), so the exporter, the handoff and ``checkpoint_tools`` move adapters
with the same machinery as the weights.

An adapter on the megatron linear ``W`` (whose rule makes it from the HF tensors ``W_1 … W_n``: q/k/v for
``linear_qkv``, gate/up for ``linear_fc1``, one for the others) is, in PEFT's terms, one adapter per ``W_i`` with
``lora_A_i = A`` and ``lora_B_i`` = the rows of ``B`` that ``W_i``'s rows are in ``W``: ``W_i + s·B_i A`` are exactly
the rows of ``W + s·B A``. So:

* ``A`` of a column-parallel linear (QKV, GATE_UP) is replicated over TP and is every ``lora_A_i``
  (:attr:`~dapo_megatron.policy.weight_mapping.Split.REPLICATED` with n HF names);
* ``B`` of a column-parallel linear splits like the weight (QKV: per query group; GATE_UP: gate shard then up shard);
* ``A`` of a row-parallel linear (o_proj, down_proj) splits like the weight (``ROW``: on its input dimension), its
  ``B`` is replicated.

Shapes use the symbolic dim ``R`` (the rank, :attr:`~dapo_megatron.policy.weight_mapping.ShardGeometry.lora_rank`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dapo_megatron.hf_format.peft_adapter import peft_name
from dapo_megatron.policy.hf_loader import model_stage_mappings, unwrap_model
from dapo_megatron.policy.lora.names import adapter_parameter_names
from dapo_megatron.policy.model_spec import ModelSpec
from dapo_megatron.policy.weight_mapping import BoundMapping, MappingRule, Split

COLUMN_SPLITS = (Split.QKV, Split.GATE_UP)


def _adapter_rules(rule: MappingRule) -> tuple[MappingRule, MappingRule]:
    """The (A, B) rules of an adapter on the weight ``rule`` makes."""
    column = rule.split in COLUMN_SPLITS
    if not column and rule.split is not Split.ROW:
        raise ValueError(f"{rule.megatron}: a {rule.split.value} weight takes no adapter")
    a_names = tuple(adapter_parameter_names(name)[0] for name in (rule.megatron, rule.megatron_te))
    b_names = tuple(adapter_parameter_names(name)[1] for name in (rule.megatron, rule.megatron_te))
    a = MappingRule(*a_names, hf=tuple(peft_name(h, "A") for h in rule.hf),
                    hf_shapes=tuple(("R", shape[1]) for shape in rule.hf_shapes),
                    split=Split.REPLICATED if column else Split.ROW, placement=rule.placement,
                    condition=rule.condition)
    b = MappingRule(*b_names, hf=tuple(peft_name(h, "B") for h in rule.hf),
                    hf_shapes=tuple((shape[0], "R") for shape in rule.hf_shapes),
                    split=rule.split if column else Split.REPLICATED, placement=rule.placement,
                    condition=rule.condition)
    return a, b


def adapter_mapping(mapping: BoundMapping, factor: str) -> BoundMapping:
    """The bound mapping of factor "A" or "B" of the adapter on ``mapping``'s weight (same layer, same expert)."""
    rule = _adapter_rules(mapping.rule)["AB".index(factor)]
    megatron_name = adapter_parameter_names(mapping.megatron_name)["AB".index(factor)]
    hf_names = tuple(h.format(layer=mapping.hf_layer, expert=mapping.expert) for h in rule.hf)
    return replace(mapping, megatron_name=megatron_name, hf_names=hf_names, hf_shapes=rule.hf_shapes,
                   split=rule.split, rule=rule)


def adapter_stage_mappings(model: torch.nn.Module, spec: ModelSpec) -> list[BoundMapping]:
    """The A and B mappings of every adapter this stage holds, in model order (the exporter's ``mappings``
    argument: it then moves adapters instead of weights)."""
    names = {name for name, _ in unwrap_model(model).named_parameters()}
    found = []
    for mapping in model_stage_mappings(model, spec):
        if mapping.split not in (*COLUMN_SPLITS, Split.ROW) or ".weight" not in mapping.megatron_name \
                or adapter_parameter_names(mapping.megatron_name)[0] not in names:
            continue
        found += [adapter_mapping(mapping, "A"), adapter_mapping(mapping, "B")]
    return found
