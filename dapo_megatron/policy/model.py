"""megatron-core's ``GPTModel`` for a :class:`~dapo_megatron.policy.model_spec.ModelSpec`, at a parallel layout and
precision, on the platform's backend.

* :func:`transformer_config` turns a spec plus the parallel layout and precision into megatron's
  ``TransformerConfig``. The layout is checked up front
  (:func:`~dapo_megatron.policy.model_spec.check_parallel_layout`).
  The decisions it takes are small functions of their own, each tested: :func:`sequence_parallel_enabled`,
  :func:`recompute_settings`, :func:`gradient_accumulation_fusion_available` and, for the batches,
  :func:`row_multiple`; the arguments it passes are :func:`transformer_config_arguments`.
* :func:`build_model` builds this pipeline stage's ``GPTModel`` with the layer spec of the platform's backend
  (:mod:`dapo_megatron.backend`: Transformer Engine on CUDA, BF16 and FP8 through TE's recipe when
  ``precision="fp8"``; else megatron's local spec with SDPA attention; the CPU layers without CUDA), the vocabulary
  padded so it splits evenly over TP ranks.
"""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING, Any, Literal

import torch

from dapo_megatron.config import ConfigError
from dapo_megatron.config.model import Precision, Recompute
from dapo_megatron.policy.model_spec import (
    ModelSpec,
    ParallelLayoutError,
    UnsupportedModelError,
    check_parallel_layout,
    padded_vocab_size,
)

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from dapo_megatron.backend.base import Backend

def sequence_parallel_enabled(requested: bool, *, tensor_parallel: int, use_transformer_engine: bool) -> bool:
    """Whether megatron's sequence parallelism is on: requested, TP > 1 and the Transformer Engine layer spec.

    It splits the activations outside the TP-sharded GEMMs (norms, residuals, dropout) over the TP ranks, so it is
    meaningless at TP 1 (megatron refuses it there). megatron's local spec refuses it too: its torch norms
    (``WrappedTorchNorm``) assert ``not sequence_parallel`` because their weights would not carry the
    ``sequence_parallel`` mark that makes ``finalize_model_grads`` all-reduce their gradients over TP. Tests force it
    on the CPU backend's spec (``transformer_config(..., sequence_parallel=True)``), whose norms carry the mark.
    """
    return requested and tensor_parallel > 1 and use_transformer_engine


def require_sequence_parallel_for_moe_training(*, has_experts: bool, tensor_parallel: int,
                                               sequence_parallel: bool, use_transformer_engine: bool) -> None:
    """megatron-core 0.16.1's MoE layer raises in training when TP > 1 runs without sequence parallelism
    (``moe_layer.py``, ``forward``); the first update would crash after a whole rollout. Refuse the layout up front,
    naming the keys to change: a :class:`~dapo_megatron.config.ConfigError` (the input checks raise it before
    anything is built, :func:`dapo_megatron.run.input_checks.check_training_layout`; one line and exit code 2
    wherever it is raised)."""
    if not has_experts or tensor_parallel < 2 or sequence_parallel:
        return
    why = ("parallel.sequence_parallel is false" if use_transformer_engine else
           "sequence parallelism needs Transformer Engine's layer spec, and this run uses megatron's local layers "
           "(no Transformer Engine, or model.kernels: local)")
    raise ConfigError(
        f"parallel.sequence_parallel / parallel.tensor: a mixture-of-experts model trains at parallel.tensor="
        f"{tensor_parallel} only with sequence parallelism (megatron-core's MoE layer refuses it otherwise), and "
        f"{why}: set parallel.sequence_parallel: true with Transformer Engine, or parallel.tensor: 1 and split the "
        f"experts with parallel.expert")


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


def transformer_config(spec: ModelSpec, backend: "Backend", **arguments) -> "TransformerConfig":
    """megatron ``TransformerConfig`` for ``spec`` on ``backend``'s platform: :func:`transformer_config_arguments`
    with the same arguments, whether Transformer Engine runs and whether CUDA does taken from the backend."""
    # megatron-core imports here and in build_model, not at the top: it takes seconds to import, and `plan` and the
    # input checks read this module without building a model.
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**transformer_config_arguments(
        spec, use_transformer_engine=backend.uses_transformer_engine, cuda_available=backend.device_type == "cuda",
        **arguments))


def transformer_config_arguments(
    spec: ModelSpec,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    params_dtype: torch.dtype | None = None,
    precision: Precision = "fp32",
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8"] = "delayed",
    use_transformer_engine: bool,
    cuda_available: bool,
    sequence_parallel: bool | None = None,
    recompute: Recompute = "none",
    expert_parallel: int = 1,
    moe_aux_loss_coeff: float = 0.0,
    moe_routing_replay: bool = False,
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
    ``recompute``: see :func:`recompute_settings`. ``use_transformer_engine`` and ``cuda_available`` are the
    backend's (:func:`transformer_config` fills them in).

    A mixture-of-experts spec adds megatron's MoE layer (:func:`moe_arguments`): ``expert_parallel`` ranks share the
    experts, ``moe_aux_loss_coeff`` weights the load-balancing loss, ``moe_routing_replay`` gives every router
    megatron's ``RouterReplay`` (:mod:`dapo_megatron.policy.moe_routing`).
    """
    check_parallel_layout(spec, tensor_parallel, pipeline_parallel, expert_parallel)
    if precision not in ("fp32", "bf16", "fp8"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp8', got {precision!r}")
    use_te = use_transformer_engine
    if precision == "fp8" and not use_te:
        raise UnsupportedModelError("precision='fp8' needs Transformer Engine on CUDA, which is not available here")
    if params_dtype is None:
        params_dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    fp8_settings: dict[str, Any] = {}
    if precision == "fp8":
        fp8_settings = dict(fp8="hybrid", fp8_recipe=fp8_recipe, fp8_margin=0, fp8_interval=1,
                            fp8_amax_history_len=1024 if fp8_recipe == "delayed" else 1,
                            fp8_amax_compute_algo="max" if fp8_recipe == "delayed" else "most_recent")
    on_cuda = cuda_available
    if sequence_parallel is None:
        sequence_parallel = sequence_parallel_enabled(True, tensor_parallel=tensor_parallel,
                                                      use_transformer_engine=use_te)
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
        qk_layernorm=spec.qk_norm,
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
        **moe_arguments(spec, expert_parallel=expert_parallel, aux_loss_coeff=moe_aux_loss_coeff,
                        routing_replay=moe_routing_replay, use_transformer_engine=use_te),
    )


def moe_arguments(spec: ModelSpec, *, expert_parallel: int, aux_loss_coeff: float, routing_replay: bool,
                  use_transformer_engine: bool) -> dict[str, Any]:
    """``TransformerConfig`` fields of a mixture-of-experts spec (none for a dense one), megatron-core 0.16.1's names.

    * Routing as Hugging Face's Qwen3-MoE routes: softmax scores, top ``k``. With ``norm_topk_prob`` HF renormalizes
      the k chosen probabilities; megatron's ``moe_router_pre_softmax=False`` takes the top k of the logits and a
      softmax over those k — the same numbers. Without it HF keeps the softmax over all experts, which is
      ``moe_router_pre_softmax=True``. The router's GEMM and softmax run in float32 (``moe_router_dtype``) whatever
      the parameters' dtype.
    * Experts are split over ``expert_parallel`` ranks (carved out of the data-parallel ones); tokens travel to their
      experts and back with the all-to-all dispatcher (gloo's ``all_to_all_single`` on CPU). No token is dropped
      (no capacity factor): every token reaches its k experts, as in HF.
    * ``aux_loss_coeff`` > 0 adds megatron's Switch-style load-balancing loss per layer ("aux_loss"); 0 trains on
      the policy loss alone (the load statistics are logged either way: :mod:`dapo_megatron.policy.moe_routing`).
    * ``moe_grouped_gemm`` with Transformer Engine (its grouped GEMM); without it the experts run one after the
      other (``SequentialMLP``: megatron's other expert module needs the ``grouped_gemm`` CUDA package). The token
      permutation around the experts is TE's fused kernel with TE (``moe_permute_fusion``), torch's gather without.
    """
    if spec.moe is None:
        if routing_replay:
            raise UnsupportedModelError(f"routing replay (algorithm.moe_routing_replay) needs a mixture-of-experts "
                                        f"model; {spec.arch} is dense")
        return {}  # expert_parallel > 1 was refused by check_parallel_layout
    moe = spec.moe
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=use_transformer_engine,
        moe_permute_fusion=use_transformer_engine,  # TE's fused token permute/unpermute (megatron needs TE >= 2.1)
        moe_router_fusion=False,
        moe_enable_routing_replay=routing_replay,
        expert_model_parallel_size=expert_parallel,
    )


def build_model(spec: ModelSpec, tconfig: "TransformerConfig", backend: "Backend",
                device: torch.device | None = None) -> "GPTModel":
    """This pipeline stage's ``GPTModel`` (pre/post process from megatron ``parallel_state``) with ``backend``'s layer
    spec, vocab padded for TP, on ``device`` (default: the backend's, :func:`model_device`)."""
    from megatron.core import parallel_state  # import cost: see transformer_config
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    if tconfig.fp8 and not backend.uses_transformer_engine:
        raise UnsupportedModelError(f"an FP8 TransformerConfig needs the Transformer Engine layer spec, not {backend}")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    configured = (tconfig.tensor_model_parallel_size, tconfig.pipeline_model_parallel_size,
                  tconfig.expert_model_parallel_size)
    if (tp, pp, ep) != configured:
        raise ParallelLayoutError(
            f"TransformerConfig is for TP={configured[0]}/PP={configured[1]}/EP={configured[2]} "
            f"but parallel_state is initialized with TP={tp}/PP={pp}/EP={ep}"
        )
    model = GPTModel(
        config=tconfig,
        transformer_layer_spec=backend.layer_spec(spec, get_num_layers_to_build(tconfig)),
        vocab_size=padded_vocab_size(spec.vocab_size, tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="none" if backend.rope_in_attention else "rope",
        rotary_base=spec.rope_theta,
        rope_scaling=spec.rope_llama3_factor is not None,
        rope_scaling_factor=spec.rope_llama3_factor or 8.0,
    )
    return place_on_device(model, model_device(backend.device_type) if device is None else device)


def model_device(device_type: str) -> torch.device:
    """Where a model stage lives: the process's current GPU on CUDA (the bare ``cuda`` device means it), else the
    CPU."""
    return torch.device("cuda") if device_type == "cuda" else torch.device("cpu")


def place_on_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Move every parameter and buffer of ``model`` to ``device``, then check none stayed behind.

    megatron builds most layers on the GPU when ``use_cpu_initialization`` is off, but not all: the MoE router's
    weight (``TopKRouter``) and the local spec's torch norms (``WrappedTorchNorm``) are created on the CPU, and only the
    distributed optimizer relocates parameters into GPU buffers; ``Float16OptimizerWithFloat16Params`` raises on a
    CPU parameter. megatron's own ``get_model`` moves the module to the current device before wrapping it; so do we.
    """
    model.to(device)
    # where a tensor made for ``device`` lands (on CPU, megatron-core's CUDA calls are redirected to the host)
    landed = torch.empty(0, device=device).device
    stray = [f"{name} ({parameter.device})" for name, parameter in model.named_parameters()
             if parameter.device.type != landed.type]
    if stray:
        raise RuntimeError(f"{len(stray)} parameter(s) are not on {device} after moving the model there: "
                           + ", ".join(stray[:10]))
    return model
