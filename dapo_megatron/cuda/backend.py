"""The two CUDA backends: Transformer Engine's layers, or megatron's local layers with torch's SDPA attention."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

from dapo_megatron.backend.base import Backend
from dapo_megatron.handoff.tp_gather import ProcessGroupGather
from dapo_megatron.policy.packing import ThdPacker
from dapo_megatron.policy.sdpa_attention import sdpa_layer_spec

if TYPE_CHECKING:
    from dapo_megatron.policy.model_spec import ModelSpec


class CudaBackend(Backend):
    """What both CUDA backends share: samples in THD rows (both attentions read ``cu_seqlens``), TP shards gathered
    over the TP process group (NCCL)."""

    def __init__(self) -> None:
        self.packer = ThdPacker()
        self.tp_gather = ProcessGroupGather()


class TransformerEngineBackend(CudaBackend):
    """CUDA with Transformer Engine: fused attention on THD rows, fused norm+linear, BF16 and FP8 GEMMs."""

    name = "cuda+transformer_engine"
    uses_transformer_engine = True

    def layer_spec(self, spec: ModelSpec, num_layers: int | None):
        # MoE: TE's grouped GEMM for the experts (moe_grouped_gemm, set by policy.model.moe_arguments)
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.moe.num_experts if spec.moe else None, moe_grouped_gemm=spec.moe is not None,
            qk_layernorm=spec.qk_norm)


class CudaLocalBackend(CudaBackend):
    """CUDA without Transformer Engine: megatron's local layers, attention by torch's fused SDPA per packed sample
    (:mod:`dapo_megatron.policy.sdpa_attention`). No FP8, no sequence parallelism (megatron's local norms refuse it)."""

    name = "cuda+local_sdpa"

    def layer_spec(self, spec: ModelSpec, num_layers: int | None):
        return sdpa_layer_spec(qk_norm=spec.qk_norm, num_experts=spec.moe.num_experts if spec.moe else None)
