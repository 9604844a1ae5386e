"""The two CUDA backends: Transformer Engine's layers, or megatron's local layers with torch's SDPA attention."""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

from dapo_megatron.backend.base import Backend
from dapo_megatron.policy.model_spec import ModelSpec
from dapo_megatron.policy.sdpa_attention import sdpa_layer_spec


class TransformerEngineBackend(Backend):
    """CUDA with Transformer Engine: fused attention on THD rows, fused norm+linear, BF16 and FP8 GEMMs."""

    name = "cuda+transformer_engine"
    uses_transformer_engine = True

    def layer_spec(self, spec: ModelSpec, num_layers: int | None):
        return get_gpt_layer_with_transformer_engine_spec()


class CudaLocalBackend(Backend):
    """CUDA without Transformer Engine: megatron's local layers, attention by torch's fused SDPA per packed sample
    (:mod:`dapo_megatron.policy.sdpa_attention`). No FP8, no sequence parallelism (megatron's local norms refuse it)."""

    name = "cuda+local_sdpa"

    def layer_spec(self, spec: ModelSpec, num_layers: int | None):
        return sdpa_layer_spec()
