"""The CPU backend's layer spec: megatron's local (non-Transformer-Engine) spec with the two modules it swaps in
besides the core attention (:mod:`dapo_megatron.cpu.attention`).

On CPU, more than half of an update of the demo-sized models is spent outside the GEMMs, much of it in elementwise
passes over the activations, and autograd runs RMSNorm and SwiGLU op by op: RMSNorm's forward is six operations and its
backward about ten; SwiGLU adds zero to its linear half (``glu_linear_offset``) and concatenates its two gradient
halves. Each module here computes the same function with a forward and backward of its own that make fewer passes:

* :class:`LocalRMSNorm` — torch's ``RMSNorm`` (same weight, same state-dict key) whose float32 forward is one
  reduction and two passes (it keeps the normalized input) and whose backward is four passes and two reductions.
  Its weight carries megatron's ``sequence_parallel`` mark when the config has it on, so that
  ``finalize_model_grads`` all-reduces its gradient over TP (each TP rank saw only its share of the tokens):
  megatron's own ``WrappedTorchNorm`` refuses sequence parallelism for want of that mark.
* :class:`SwiGLUMLP` — megatron's ``MLP`` whose activation is :func:`swiglu`: ``silu(gate) · up`` in two passes,
  its backward writing both gradient halves straight into one buffer (three passes, no concatenation).

Results equal megatron's modules up to float rounding (tests/unit/test_cpu_layers.py: backward against
numerical derivatives, values and gradients against torch's and megatron's own, with controls). Section 4 of
``python bench/profile_dapo_step.py`` times an update with these layers and with the same layers op by op.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from torch import Tensor

from dapo_megatron.cpu.attention import PackedSequenceAttention, RotarySettings


class _RMSNorm(torch.autograd.Function):
    """``weight · x · rstd`` with ``rstd = 1 / sqrt(mean(x²) + eps)`` over the last dimension."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        # vector_norm is one fused reduction; vecdot / pow+mean write x² first
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        normalized = x * rstd
        ctx.save_for_backward(normalized, weight, rstd)
        return normalized * weight

    @staticmethod
    def backward(ctx, grad: Tensor):
        normalized, weight, rstd = ctx.saved_tensors
        grad_normalized = grad * weight
        # d/dx of x·rstd: rstd · (g - x̂ · mean(g · x̂)), g the gradient of the normalized x̂
        # the row dot products as one batched matmul: vecdot writes the products first
        mean_dot = (grad_normalized.unsqueeze(-2) @ normalized.unsqueeze(-1)).squeeze(-1).div_(normalized.shape[-1])
        grad_x = torch.addcmul(grad_normalized, normalized, mean_dot, value=-1).mul_(rstd)
        grad_weight = (grad * normalized).reshape(-1, normalized.shape[-1]).sum(0)
        return grad_x, grad_weight, None


class LocalRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built with megatron's norm signature; float32 through :class:`_RMSNorm` (see the module
    docstring), other dtypes through torch's own forward."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            return _RMSNorm.apply(x, self.weight, self.eps)
        return super().forward(x)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) · up`` of ``x = [gate, up]`` (last dimension, halves)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        gate, up = x.chunk(2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(gate, up, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        gate, up, activated = ctx.saved_tensors
        grad_x = grad.new_empty(*grad.shape[:-1], 2 * grad.shape[-1])
        grad_gate, grad_up = grad_x.chunk(2, dim=-1)
        torch.mul(grad, up, out=grad_gate)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)  # in place, element-wise
        torch.mul(grad, activated, out=grad_up)
        return grad_x


def swiglu(x: Tensor) -> Tensor:
    return _SwiGLU.apply(x)


class SwiGLUMLP(MLP):
    """megatron's ``MLP`` (same ``linear_fc1``/``linear_fc2``, same TP layout: each rank's fc1 output is its gate
    half, then its up half) with :func:`swiglu` as the activation. Built only for the plain SwiGLU config this
    project's models have.

    The layer spec names the class itself, not a ``ModuleSpec`` of it: megatron's ``TransformerLayer`` logs
    "Unknown MLP type" for a ``ModuleSpec`` of any ``MLP`` subclass, and the TP group it would pass is the one ``MLP``
    falls back to. The linears default to the local spec's."""

    def __init__(self, config, submodules: MLPSubmodules | None = None, **kwargs) -> None:
        unsupported = [f"{name}={getattr(config, name)!r}" for name, plain in (
            ("gated_linear_unit", True), ("activation_func", F.silu), ("bias_activation_fusion", False),
            ("use_te_activation_func", False), ("activation_func_clamp_value", None), ("glu_linear_offset", 0.0),
        ) if getattr(config, name) != plain]
        if unsupported:
            raise ValueError("SwiGLUMLP is SwiGLU without fusions; the config has " + ", ".join(unsupported))
        submodules = submodules or MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        kwargs.setdefault("ffn_hidden_size", config.ffn_hidden_size)
        super().__init__(config, submodules, **kwargs)

    def forward(self, hidden_states: Tensor, per_token_scale: Tensor | None = None, **kwargs):
        if per_token_scale is not None:
            raise ValueError("SwiGLUMLP has no per-token scaling (a mixture-of-experts feature)")
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(swiglu(intermediate))


def local_layer_spec(rotary: RotarySettings, num_layers: int | None = None, *, qk_norm: bool = False,
                     num_experts: int | None = None):
    """megatron's local GPT layer spec with :class:`LocalRMSNorm`, :class:`SwiGLUMLP` and the packed-sequence core
    attention that applies ``rotary`` itself.

    ``qk_norm``: a :class:`LocalRMSNorm` of each query and key head (megatron's ``q_layernorm`` / ``k_layernorm``);
    megatron applies them in ``get_query_key_value_tensors``, before the core attention, so queries and keys are
    normalized before this spec's attention rotates them — Qwen3's order. ``num_experts``: the MLP is megatron's
    ``MoELayer`` with its ``SequentialMLP`` experts (one megatron ``MLP`` per local expert, run one after the other:
    megatron's grouped-GEMM experts need Transformer Engine or the ``grouped_gemm`` CUDA package).

    With ``num_layers`` (this pipeline stage's), a block spec whose final norm is a :class:`LocalRMSNorm` too."""
    layer = copy.deepcopy(get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                   qk_layernorm=qk_norm, normalization="RMSNorm"))
    layer.submodules.input_layernorm = LocalRMSNorm
    layer.submodules.pre_mlp_layernorm = LocalRMSNorm
    if num_experts is None:
        layer.submodules.mlp = SwiGLUMLP
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = ModuleSpec(module=PackedSequenceAttention, params={"rotary": rotary})
    if qk_norm:
        attention.q_layernorm = attention.k_layernorm = LocalRMSNorm
    if num_layers is None:
        return layer
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=LocalRMSNorm)
