"""What a Hugging Face decoder is, in the terms megatron needs: :func:`model_spec_from_hf` reads a ``transformers``
config into a :class:`ModelSpec`, the frozen list of what this project supports (GQA, QKV bias, RMSNorm eps, RoPE base,
llama3 RoPE scaling, SwiGLU, tied embeddings). Anything else — another architecture, attention/MLP biases Llama does
not have, sliding-window attention, another RoPE scaling — is an :class:`UnsupportedModelError` naming the field,
never a silently different model.

Also here, because they are facts of the model's shape: the vocabulary padding megatron applies so the vocabulary
splits evenly over TP ranks (:func:`padded_vocab_size`; the padded logit rows are not tokens, ``ModelSpec.vocab_size``
is the real size) and whether a shape splits over a TP/PP layout at all (:func:`check_parallel_layout`: megatron splits
attention by query group, so the number of KV heads must be divisible by the tensor-parallel size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = {
    # HF ``model_type`` → (architecture class name, whether q/k/v projections carry a bias)
    "qwen2": ("Qwen2ForCausalLM", True),
    "llama": ("LlamaForCausalLM", False),
}

# megatron-core's llama3 RoPE scaling hard-codes these three (RotaryEmbedding._apply_scaling); only ``factor`` is free.
_MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedModelError(ValueError):
    """The Hugging Face config describes a model (or a feature of one) this project cannot build faithfully."""


class ParallelLayoutError(ValueError):
    """The model's shape cannot be split over the requested tensor/pipeline-parallel layout."""


@dataclass(frozen=True)
class ModelSpec:
    """What a supported HF decoder is, in the terms megatron needs. ``vocab_size`` is the real (unpadded) size."""

    arch: str  # HF model_type: "qwen2" or "llama"
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

    @property
    def queries_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads


def _rope_settings(hf_config: Any) -> tuple[float, dict]:
    """(rope base, rope-scaling dict or {}) from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``."""
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
    """Read a ``transformers`` config (Qwen2Config / LlamaConfig) into a :class:`ModelSpec`, rejecting what we can't build."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        archs = getattr(hf_config, "architectures", None)
        raise UnsupportedModelError(
            f"unsupported architecture model_type={model_type!r} (architectures={archs}); "
            f"supported: {', '.join(cls for cls, _ in SUPPORTED_ARCHITECTURES.values())}"
        )
    _, qkv_bias = SUPPORTED_ARCHITECTURES[model_type]
    where = f"{model_type} config"

    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act={act!r} is not supported (SwiGLU needs 'silu')")
    if model_type == "llama":
        if getattr(hf_config, "attention_bias", False):
            raise UnsupportedModelError(f"{where}: attention_bias=True (q/k/v/o biases) is not supported")
        if getattr(hf_config, "mlp_bias", False):
            raise UnsupportedModelError(f"{where}: mlp_bias=True is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise UnsupportedModelError(f"{where}: use_sliding_window=True is not supported (full attention only)")

    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise UnsupportedModelError(f"{where}: num_attention_heads={heads} not divisible by num_key_value_heads={kv_heads}")
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
        qkv_bias=qkv_bias,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        rope_llama3_factor=_llama3_factor(scaling),
    )


VOCAB_DIVISIBLE_BY = 128  # each TP rank's share of the padded vocab is a multiple of this


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Smallest multiple of ``divisible_by × tensor_parallel`` that is ≥ ``vocab_size`` (megatron's padding rule)."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def check_parallel_layout(spec: ModelSpec, tensor_parallel: int, pipeline_parallel: int) -> None:
    """Raise :class:`ParallelLayoutError` when the model cannot be split as asked (checked before any allocation)."""
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise ParallelLayoutError(f"tensor_parallel={tensor_parallel} and pipeline_parallel={pipeline_parallel} must be >= 1")
    if spec.num_kv_heads % tensor_parallel:
        raise ParallelLayoutError(
            f"num_key_value_heads={spec.num_kv_heads} is not divisible by tensor_parallel={tensor_parallel}: megatron "
            f"splits attention by KV group, so use tensor_parallel <= {spec.num_kv_heads} dividing it"
        )
    if spec.num_attention_heads % tensor_parallel:
        raise ParallelLayoutError(
            f"num_attention_heads={spec.num_attention_heads} is not divisible by tensor_parallel={tensor_parallel}"
        )
    if spec.ffn_hidden_size % tensor_parallel:
        raise ParallelLayoutError(
            f"intermediate_size={spec.ffn_hidden_size} is not divisible by tensor_parallel={tensor_parallel}"
        )
    if spec.num_layers % pipeline_parallel:
        raise ParallelLayoutError(
            f"num_hidden_layers={spec.num_layers} is not divisible by pipeline_parallel={pipeline_parallel}"
        )
