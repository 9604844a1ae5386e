"""Hugging Face config → megatron-core ``GPTModel`` for the dense Qwen2 / Qwen2.5 / Llama-3 family.

Three steps, each with one job:

* :func:`model_spec_from_hf` reads a ``transformers`` config into a :class:`ModelSpec`, the frozen list of what this
  project supports (GQA, QKV bias, RMSNorm eps, RoPE base, llama3 RoPE scaling, SwiGLU, tied embeddings). Anything
  else — another architecture, attention/MLP biases Llama does not have, sliding-window attention, another RoPE
  scaling — is a :class:`UnsupportedModelError` naming the field, never a silently different model.
* :func:`transformer_config` turns a spec plus the parallel layout and precision into megatron's
  ``TransformerConfig``. The layout is checked up front: megatron splits attention by query group, so the number of
  KV heads must be divisible by the tensor-parallel size (megatron would otherwise build a different, replicated-KV
  layout this project's weight mapping does not describe). The decisions it takes are small functions of their own,
  each tested: :func:`sequence_parallel_enabled`, :func:`effective_recompute` and :func:`recompute_settings`,
  :func:`gradient_accumulation_fusion_available` and, for the batches, :func:`row_multiple`; the arguments it
  passes are :func:`transformer_config_arguments`.
* :func:`build_model` builds this pipeline stage's ``GPTModel`` with the Transformer Engine layer spec when TE and
  CUDA are present (BF16, and FP8 through TE's recipe when ``precision="fp8"``), else megatron's local spec.

The model always has the vocabulary padded to :func:`padded_vocab_size` so it splits evenly over TP ranks; the padded
logit rows are not tokens (``ModelSpec.vocab_size`` is the real size; log-prob code masks the rest).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

Precision = Literal["fp32", "bf16", "fp8"]

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


def transformer_engine_usable() -> bool:
    """True when CUDA is present and Transformer Engine imports (then the TE layer spec is used)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


Recompute = Literal["selective", "full", "none"]


def sequence_parallel_enabled(requested: bool, *, tensor_parallel: int, use_transformer_engine: bool) -> bool:
    """Whether megatron's sequence parallelism is on: requested, TP > 1 and the Transformer Engine layer spec.

    It splits the activations outside the TP-sharded GEMMs (norms, residuals, dropout) over the TP ranks, so it is
    meaningless at TP 1 (megatron refuses it there). megatron's local spec refuses it too: its torch norms
    (``WrappedTorchNorm``) assert ``not sequence_parallel`` because their weights would not carry the
    ``sequence_parallel`` mark that makes ``finalize_model_grads`` all-reduce their gradients over TP. Tests force it
    on the local spec (``transformer_config(..., sequence_parallel=True)``), whose norms carry the mark
    (:class:`dapo_megatron.policy.local_layers.LocalRMSNorm`).
    """
    return requested and tensor_parallel > 1 and use_transformer_engine


def recompute_settings(recompute: Recompute) -> dict[str, Any]:
    """``TransformerConfig`` fields for activation recomputation (megatron-core 0.16.1's names).

    * "selective": ``recompute_granularity="selective"`` with megatron's default module set ``["core_attn"]`` — the
      attention scores and softmax (quadratic in the row length) are recomputed in backward instead of kept. With
      fused (TE flash) attention they are never materialized, so this costs a little recompute and saves little.
    * "full": ``recompute_granularity="full"``, ``recompute_method="uniform"``, ``recompute_num_layers=1`` — each
      layer keeps only its input and is recomputed whole in backward.
    * "none": keep every activation.
    """
    if recompute == "none":
        return dict(recompute_granularity=None)
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    raise ValueError(f"recompute must be 'selective', 'full' or 'none', got {recompute!r}")


def effective_recompute(requested: Recompute, *, cuda_available: bool) -> Recompute:
    """The recomputation a training run uses: as configured on GPU; "none" without CUDA, where memory is not what
    limits a run (the CPU demo) and recomputing would only cost time."""
    return requested if cuda_available else "none"


def gradient_accumulation_fusion_available(*, cuda_available: bool | None = None) -> bool:
    """Whether weight gradients can be accumulated straight into the fp32 ``main_grad`` inside the GEMM.

    megatron's own linear layers (the output layer on every spec, all layers on the local spec) need apex's
    ``fused_weight_gradient_mlp_cuda`` extension for it and raise at construction without it; Transformer Engine's
    layers fuse it themselves. So: CUDA and that extension importable.
    """
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    return cuda_available and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


FP8_ROW_ALIGNMENT = {"mxfp8": 32}  # megatron.core.fp8_utils.get_fp8_align_size: 32 for MXFP8, else 16
DEFAULT_FP8_ROW_ALIGNMENT = 16


def row_multiple(*, fp8_recipe: str | None, sequence_parallel: bool, tensor_parallel: int) -> int:
    """Every packed row (filler micro-batches included) must have a length that is a multiple of this.

    ``fp8_recipe`` is None without FP8. Under sequence parallelism megatron splits each row's tokens evenly over the
    TP ranks (a multiple of TP). FP8 GEMMs in Transformer Engine need the token dimension divisible by 16 (32 for
    MXFP8: ``megatron.core.fp8_utils.get_fp8_align_size``); the TP GEMMs see the whole row (sequence parallelism
    all-gathers before them and reduce-scatters after), so it is the row length that must align. Both: their least
    common multiple (the same rule verl applies to packed rows).
    """
    multiple = 1
    if fp8_recipe is not None:
        multiple = FP8_ROW_ALIGNMENT.get(str(getattr(fp8_recipe, "value", fp8_recipe)), DEFAULT_FP8_ROW_ALIGNMENT)
    if sequence_parallel:
        multiple = math.lcm(multiple, tensor_parallel)
    return multiple


def config_row_multiple(tconfig) -> int:
    """:func:`row_multiple` of a megatron ``TransformerConfig``."""
    return row_multiple(fp8_recipe=tconfig.fp8_recipe if tconfig.fp8 else None,
                        sequence_parallel=tconfig.sequence_parallel,
                        tensor_parallel=tconfig.tensor_model_parallel_size)


def transformer_config(spec: ModelSpec, **arguments):
    """megatron ``TransformerConfig`` for ``spec``: :func:`transformer_config_arguments` takes the same arguments."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**transformer_config_arguments(spec, **arguments))


def transformer_config_arguments(
    spec: ModelSpec,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    params_dtype: torch.dtype | None = None,
    precision: Precision = "fp32",
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8"] = "delayed",
    use_transformer_engine: bool | None = None,
    sequence_parallel: bool | None = None,
    recompute: Recompute = "none",
    cuda_available: bool | None = None,
) -> dict[str, Any]:
    """The keyword arguments of megatron's ``TransformerConfig`` for ``spec`` at this layout and precision.

    ``precision``: "fp32" (params fp32, no autocast), "bf16" (params bf16), "fp8" (params bf16; the GEMMs of every
    transformer layer run in FP8 through Transformer Engine with ``fp8_recipe``, format "hybrid": e4m3 forward,
    e5m2 gradients — megatron wraps the layers in TE's ``fp8_autocast`` itself when ``config.fp8`` is set). FP8 needs
    Transformer Engine on CUDA; asking for it elsewhere is an error. ``params_dtype`` defaults from ``precision``.
    Fusions that need apex or TE kernels are turned off without TE (bias+activation, bias+dropout, RoPE);
    gradient-accumulation fusion is on where :func:`gradient_accumulation_fusion_available`.

    ``sequence_parallel``: None takes :func:`sequence_parallel_enabled` (requested, TP > 1, TE); True forces it
    (TP > 1 needed; the local spec's norms then carry megatron's ``sequence_parallel`` mark).
    ``recompute``: see :func:`recompute_settings`. ``cuda_available`` (default: ``torch.cuda.is_available()``) is for
    tests of the decisions.
    """
    check_parallel_layout(spec, tensor_parallel, pipeline_parallel)
    if precision not in ("fp32", "bf16", "fp8"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp8', got {precision!r}")
    use_te = transformer_engine_usable() if use_transformer_engine is None else use_transformer_engine
    if precision == "fp8" and not use_te:
        raise UnsupportedModelError("precision='fp8' needs Transformer Engine on CUDA, which is not available here")
    if params_dtype is None:
        params_dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    fp8_settings: dict[str, Any] = {}
    if precision == "fp8":
        fp8_settings = dict(fp8="hybrid", fp8_recipe=fp8_recipe, fp8_margin=0, fp8_interval=1,
                            fp8_amax_history_len=1024 if fp8_recipe == "delayed" else 1,
                            fp8_amax_compute_algo="max" if fp8_recipe == "delayed" else "most_recent")
    on_cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if sequence_parallel is None:
        sequence_parallel = sequence_parallel_enabled(True, tensor_parallel=tensor_parallel, use_transformer_engine=use_te)
    elif sequence_parallel and tensor_parallel < 2:
        raise ParallelLayoutError(f"sequence_parallel needs tensor_parallel > 1, got {tensor_parallel}")
    return dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=not on_cuda,
        perform_initialization=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=use_te,
        bias_dropout_fusion=use_te,
        apply_rope_fusion=use_te,
        gradient_accumulation_fusion=gradient_accumulation_fusion_available(cuda_available=on_cuda),
        persist_layer_norm=False,
        **recompute_settings(recompute),
        **fp8_settings,
    )


def layer_spec(use_transformer_engine: bool, spec: ModelSpec, tconfig=None):
    """megatron spec: TE modules (fused norm+linear, FP8-capable) or the local spec of
    :mod:`dapo_megatron.policy.local_layers` (torch modules with hand-written backward passes and a core attention
    that applies ``spec``'s RoPE itself and takes packed rows), as a block spec for this pipeline stage when
    ``tconfig`` is given."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from dapo_megatron.policy.cpu_attention import RotarySettings
    from dapo_megatron.policy.local_layers import local_layer_spec

    if use_transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec()
    return local_layer_spec(RotarySettings(spec.rope_theta, spec.rope_llama3_factor),
                            None if tconfig is None else get_num_layers_to_build(tconfig))


def build_model(spec: ModelSpec, tconfig, *, use_transformer_engine: bool | None = None):
    """This pipeline stage's ``GPTModel`` (pre/post process from megatron ``parallel_state``), vocab padded for TP."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    use_te = transformer_engine_usable() if use_transformer_engine is None else use_transformer_engine
    if tconfig.fp8 and not use_te:
        raise UnsupportedModelError("an FP8 TransformerConfig needs the Transformer Engine layer spec")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if (tp, pp) != (tconfig.tensor_model_parallel_size, tconfig.pipeline_model_parallel_size):
        raise ParallelLayoutError(
            f"TransformerConfig is for TP={tconfig.tensor_model_parallel_size}/PP={tconfig.pipeline_model_parallel_size} "
            f"but parallel_state is initialized with TP={tp}/PP={pp}"
        )
    return GPTModel(
        config=tconfig,
        transformer_layer_spec=layer_spec(use_te, spec, tconfig),
        vocab_size=padded_vocab_size(spec.vocab_size, tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope" if use_te else "none",  # the local spec's attention applies RoPE itself
        rotary_base=spec.rope_theta,
        rope_scaling=spec.rope_llama3_factor is not None,
        rope_scaling_factor=spec.rope_llama3_factor or 8.0,
    )
