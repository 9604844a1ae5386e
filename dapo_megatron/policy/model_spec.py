"""What a Hugging Face decoder is, in the terms megatron needs: :func:`model_spec_from_hf` reads a ``transformers``
config into a :class:`ModelSpec`, the frozen list of what this project supports (GQA, QKV bias, per-head q/k RMSNorm,
a head dimension of its own, RMSNorm eps, RoPE base, llama3 RoPE scaling, SwiGLU, tied embeddings, and top-k routed
SwiGLU experts: :class:`MoESpec`). Anything else — another architecture, attention/MLP biases the family does not
have, sliding-window attention, another RoPE scaling, dense layers between MoE layers — is an
:class:`UnsupportedModelError` naming the field, never a silently different model.

The families (:data:`FAMILIES`): Qwen2 / Qwen2.5 (QKV bias), Llama-3, Qwen3 (q/k RMSNorm per head before RoPE, no
biases, ``head_dim`` decoupled from ``hidden_size / heads``) and Qwen3-MoE (Qwen3 attention, every layer's MLP a
router over ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token,
their weights renormalized to sum to 1 when ``norm_topk_prob``).

Also here, because they are facts of the model's shape: the vocabulary padding megatron applies so the vocabulary
splits evenly over TP ranks (:func:`padded_vocab_size`; the padded logit rows are not tokens, ``ModelSpec.vocab_size``
is the real size) and whether a shape splits over a TP/PP layout at all (:func:`check_parallel_layout`: megatron splits
attention by query group, so the number of KV heads must be divisible by the tensor-parallel size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """What an HF ``model_type`` fixes: its architecture class, whether q/k/v carry a bias, whether queries and keys
    are RMS-normalized per head, whether its MLPs are mixtures of experts."""

    architecture: str
    qkv_bias: bool
    qk_norm: bool = False
    moe: bool = False


FAMILIES = {
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True),
    "llama": Family("LlamaForCausalLM", qkv_bias=False),
    "qwen3": Family("Qwen3ForCausalLM", qkv_bias=False, qk_norm=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True, moe=True),
}

# megatron-core's llama3 RoPE scaling hard-codes these three (RotaryEmbedding._apply_scaling); only ``factor`` is free.
_MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedModelError(ValueError):
    """The Hugging Face config describes a model (or a feature of one) this project cannot build faithfully."""


class ParallelLayoutError(ValueError):
    """The model's shape cannot be split over the requested tensor/pipeline-parallel layout."""


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts MLP of every layer: ``num_experts`` SwiGLU experts of width ``ffn_hidden_size``, a
    linear router (no bias) choosing ``topk`` per token by softmax probability; with ``norm_topk_prob`` the chosen
    probabilities are renormalized to sum to 1 (megatron: top-k on the logits, then a softmax over those k, which
    is the same), else they are the softmax over all experts (megatron: ``moe_router_pre_softmax``)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    norm_topk_prob: bool


@dataclass(frozen=True)
class ModelSpec:
    """What a supported HF decoder is, in the terms megatron needs. ``vocab_size`` is the real (unpadded) size."""

    arch: str  # HF model_type: a key of FAMILIES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tie_embeddings: bool
    max_position_embeddings: int
    rope_llama3_factor: float | None = None  # llama3 RoPE scaling factor, None for plain RoPE
    qk_norm: bool = False  # RMSNorm of each query and key head (weights [head_dim]) before RoPE
    moe: MoESpec | None = None  # None: dense SwiGLU MLPs of ffn_hidden_size

    @property
    def queries_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads


def _rope_settings(hf_config: Any) -> tuple[float, dict]:
    """(rope base, rope-scaling dict or {}) from ``rope_parameters`` (transformers 5) or
    ``rope_theta``/``rope_scaling``."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), params
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        raise UnsupportedModelError("config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta), dict(getattr(hf_config, "rope_scaling", None) or {})


def _llama3_factor(scaling: dict) -> float | None:
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type in ("default", None):
        return None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"RoPE scaling type {rope_type!r} is not supported (supported: default, llama3); config: {scaling}"
        )
    for key, required in _MEGATRON_LLAMA3_FIXED.items():
        if float(scaling.get(key, required)) != required:
            raise UnsupportedModelError(
                f"llama3 RoPE scaling with {key}={scaling[key]} is not supported: megatron-core fixes it to {required}"
            )
    return float(scaling["factor"])


def model_spec_from_hf(hf_config: Any) -> ModelSpec:
    """Read a ``transformers`` config (Qwen2Config / LlamaConfig) into a :class:`ModelSpec`, rejecting what we
    can't build."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILIES:
        archs = getattr(hf_config, "architectures", None)
        raise UnsupportedModelError(
            f"unsupported architecture model_type={model_type!r} (architectures={archs}); "
            f"supported: {', '.join(family.architecture for family in FAMILIES.values())}"
        )
    family = FAMILIES[model_type]
    where = f"{model_type} config"

    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act={act!r} is not supported (SwiGLU needs 'silu')")
    if not family.qkv_bias:
        if getattr(hf_config, "attention_bias", False):
            raise UnsupportedModelError(f"{where}: attention_bias=True (q/k/v/o biases) is not supported")
        if getattr(hf_config, "mlp_bias", False):
            raise UnsupportedModelError(f"{where}: mlp_bias=True is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise UnsupportedModelError(f"{where}: use_sliding_window=True is not supported (full attention only)")

    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise UnsupportedModelError(f"{where}: num_attention_heads={heads} not divisible by "
                                    f"num_key_value_heads={kv_heads}")
    hidden = int(hf_config.hidden_size)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    rope_theta, scaling = _rope_settings(hf_config)
    return ModelSpec(
        arch=model_type,
        vocab_size=int(hf_config.vocab_size),
        hidden_size=hidden,
        num_layers=int(hf_config.num_hidden_layers),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=int(hf_config.intermediate_size),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=rope_theta,
        qkv_bias=family.qkv_bias,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        rope_llama3_factor=_llama3_factor(scaling),
        qk_norm=family.qk_norm,
        moe=_moe_spec(hf_config, where) if family.moe else None,
    )


def _moe_spec(hf_config: Any, where: str) -> MoESpec:
    """The experts of a Qwen3-MoE config; every layer must be a MoE layer (megatron's ``moe_layer_freq=1``)."""
    num_layers = int(hf_config.num_hidden_layers)
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = sorted(set(getattr(hf_config, "mlp_only_layers", None) or [])
                   | {layer for layer in range(num_layers) if (layer + 1) % step})
    if dense:
        raise UnsupportedModelError(
            f"{where}: layers {dense} have dense MLPs (mlp_only_layers / decoder_sparse_step={step}); only models "
            f"whose every layer is a mixture of experts are supported")
    experts = int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0))
    topk = int(hf_config.num_experts_per_tok)
    if experts < 1 or not 1 <= topk <= experts:
        raise UnsupportedModelError(f"{where}: num_experts={experts} with num_experts_per_tok={topk} is not a "
                                    f"top-k router (1 <= num_experts_per_tok <= num_experts)")
    norm_topk_prob = bool(getattr(hf_config, "norm_topk_prob", False))
    if topk == 1 and norm_topk_prob:
        raise UnsupportedModelError(f"{where}: num_experts_per_tok=1 with norm_topk_prob=True (every weight 1.0) is "
                                    f"not supported: megatron's softmax router needs pre-softmax routing at top-1")
    if int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0):
        raise UnsupportedModelError(f"{where}: shared experts (shared_expert_intermediate_size) are not supported")
    return MoESpec(num_experts=experts, topk=topk, ffn_hidden_size=int(hf_config.moe_intermediate_size),
                   norm_topk_prob=norm_topk_prob)


VOCAB_DIVISIBLE_BY = 128  # each TP rank's share of the padded vocab is a multiple of this


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Smallest multiple of ``divisible_by × tensor_parallel`` that is ≥ ``vocab_size`` (megatron's padding rule)."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def check_parallel_layout(spec: ModelSpec, tensor_parallel: int, pipeline_parallel: int,
                          expert_parallel: int = 1) -> None:
    """Raise :class:`ParallelLayoutError` when the model cannot be split as asked (checked before any allocation).
    ``expert_parallel`` splits a MoE model's experts over that many data-parallel ranks (each holds
    ``num_experts / expert_parallel`` of every layer's experts, each expert TP-split like a dense MLP)."""
    if tensor_parallel < 1 or pipeline_parallel < 1 or expert_parallel < 1:
        raise ParallelLayoutError(f"tensor_parallel={tensor_parallel}, pipeline_parallel={pipeline_parallel} and "
                                  f"expert_parallel={expert_parallel} must be >= 1")
    if spec.moe is None and expert_parallel > 1:
        raise ParallelLayoutError(f"expert_parallel={expert_parallel} needs a mixture-of-experts model; "
                                  f"{spec.arch} is dense")
    if spec.moe is not None:
        if spec.moe.num_experts % expert_parallel:
            raise ParallelLayoutError(
                f"num_experts={spec.moe.num_experts} is not divisible by expert_parallel={expert_parallel}: megatron "
                f"gives every expert-parallel rank the same number of experts")
        if spec.moe.ffn_hidden_size % tensor_parallel:
            raise ParallelLayoutError(f"moe_intermediate_size={spec.moe.ffn_hidden_size} is not divisible by "
                                      f"tensor_parallel={tensor_parallel}")
    if spec.num_kv_heads % tensor_parallel:
        raise ParallelLayoutError(
            f"num_key_value_heads={spec.num_kv_heads} is not divisible by tensor_parallel={tensor_parallel}: megatron "
            f"splits attention by KV group, so use tensor_parallel <= {spec.num_kv_heads} dividing it"
        )
    if spec.num_attention_heads % tensor_parallel:
        raise ParallelLayoutError(
            f"num_attention_heads={spec.num_attention_heads} is not divisible by tensor_parallel={tensor_parallel}"
        )
    if spec.moe is None and spec.ffn_hidden_size % tensor_parallel:
        raise ParallelLayoutError(
            f"intermediate_size={spec.ffn_hidden_size} is not divisible by tensor_parallel={tensor_parallel}"
        )
    if spec.num_layers % pipeline_parallel:
        raise ParallelLayoutError(
            f"num_hidden_layers={spec.num_layers} is not divisible by pipeline_parallel={pipeline_parallel}"
        )
