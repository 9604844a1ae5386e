"""How big LoRA's adapters are next to the model they are on: what ``plan`` counts and what a run logs
(``lora/trainable_fraction``, ``lora/handoff_fraction``).

Per layer, with ``r`` the rank, ``h`` hidden, ``q``/``k`` the query/key-value widths, ``F`` the FFN width (``M``
an expert's, ``E`` experts): ``linear_qkv`` ``r·h + (q + 2k)·r``, ``linear_proj`` ``r·q + h·r``, ``linear_fc1``
``r·h + 2F·r`` and ``linear_fc2`` ``r·F + h·r`` (per expert with ``M`` for a mixture-of-experts layer). PEFT's form
(what the handoff sends) has one ``lora_A`` per HF module: ``linear_qkv``'s ``A`` travels three times (q, k, v),
``linear_fc1``'s twice (gate, up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dapo_megatron.policy.memory.gpu import layer_parameters, moe_layer_parameters
from dapo_megatron.policy.model_spec import ModelSpec

HF_MODULES = {"linear_qkv": 3, "linear_proj": 1, "linear_fc1": 2, "linear_fc2": 1}  # HF modules per megatron linear


@dataclass(frozen=True)
class AdapterSizes:
    """Parameter counts of one model's adapters: in megatron's layout (what trains), in PEFT's (what is sent),
    and of the model itself (every HF tensor, as a full handoff sends them)."""

    trainable: int
    handoff: int
    model: int

    @property
    def trainable_fraction(self) -> float:
        return self.trainable / self.model

    @property
    def handoff_fraction(self) -> float:
        return self.handoff / self.model


def linear_shapes(spec: ModelSpec) -> dict[str, tuple[int, int, int]]:
    """(in, out, copies per layer) of each adaptable linear."""
    q, k, h = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size
    ffn, copies = (spec.ffn_hidden_size, 1) if spec.moe is None else (spec.moe.ffn_hidden_size, spec.moe.num_experts)
    return {"linear_qkv": (h, q + 2 * k, 1), "linear_proj": (q, h, 1), "linear_fc1": (h, 2 * ffn, copies),
            "linear_fc2": (ffn, h, copies)}


def model_parameter_count(spec: ModelSpec) -> int:
    """Every parameter of the HF model (the unpadded vocabulary; a tied output layer once; a MoE model's experts)."""
    layer = layer_parameters(spec, 1) + moe_layer_parameters(spec, 1, 1)
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_embeddings else 2)
    return spec.num_layers * layer + embeddings + spec.hidden_size


def adapter_sizes(spec: ModelSpec, *, rank: int, target_modules: Sequence[str]) -> AdapterSizes:
    """The sizes of rank-``rank`` adapters on ``target_modules`` of every layer of ``spec``."""
    trainable = handoff = 0
    for name, (n_in, n_out, copies) in linear_shapes(spec).items():
        if name in target_modules:
            trainable += copies * rank * (n_in + n_out)
            handoff += copies * rank * (HF_MODULES[name] * n_in + n_out)
    return AdapterSizes(trainable=spec.num_layers * trainable, handoff=spec.num_layers * handoff,
                        model=model_parameter_count(spec))
