"""The local spec's hand-written layers (policy/local_layers.py: RMSNorm, SwiGLU; policy/cpu_attention.py: RoPE):
their backward passes against numerical derivatives (``gradcheck``, float64), their float32 values and gradients
against the modules they replace, and the configs they refuse. The whole local-spec model against megatron's stock
local model is tests/integration/test_cpu_attention.py::test_the_local_spec_is_megatrons_stock_local_model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.transformer.transformer_config import TransformerConfig

from dapo_megatron.cpu.attention import _rotate
from dapo_megatron.cpu.layers import LocalRMSNorm, SwiGLUMLP, _RMSNorm, swiglu


def tiny_config(**overrides) -> TransformerConfig:
    settings = dict(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16, gated_linear_unit=True,
                    activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm")
    return TransformerConfig(**{**settings, **overrides})


def random(*shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def values_and_grads(fn, *inputs: torch.Tensor, weights: torch.Tensor):
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*inputs)
    return out.detach(), torch.autograd.grad((out * weights).sum(), inputs)


def assert_close_in_float32(ours, reference, *inputs: torch.Tensor, weights: torch.Tensor) -> None:
    """``ours`` on float32 inputs against ``reference`` on the same values in float64."""
    got, got_grads = values_and_grads(ours, *(x.float() for x in inputs), weights=weights.float())
    want, want_grads = values_and_grads(reference, *inputs, weights=weights)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad.double(), want_grad, atol=2e-5, rtol=1e-5)


# ---- RMSNorm -------------------------------------------------------------------------------------------------------
def test_rms_norm_backward_is_the_derivative_of_its_forward():
    x, weight = random(5, 2, 6, seed=0).requires_grad_(), random(6, seed=1).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: _RMSNorm.apply(x, w, 1e-5), (x, weight))


def test_rms_norm_equals_torchs_rms_norm():
    x, weight, out_weights = random(40, 1, 32, seed=2), random(32, seed=3), random(40, 1, 32, seed=4)

    def reference(x, w):
        return F.rms_norm(x, (32,), w, 1e-6)

    assert_close_in_float32(lambda x, w: _RMSNorm.apply(x, w, 1e-6), reference, x, weight, weights=out_weights)
    # the module takes that path in float32 ...
    norm = LocalRMSNorm(tiny_config(), hidden_size=32, eps=1e-6)
    out = norm(x.float().requires_grad_())
    assert type(out.grad_fn).__name__ == "_RMSNormBackward"
    torch.testing.assert_close(out, F.rms_norm(x.float(), (32,), norm.weight, 1e-6), atol=2e-6, rtol=0)
    # ... and torch's own in other dtypes
    bf16 = LocalRMSNorm(tiny_config(), hidden_size=32, eps=1e-6).to(torch.bfloat16)
    assert torch.equal(bf16(x.bfloat16()), F.rms_norm(x.bfloat16(), (32,), bf16.weight, 1e-6))
    # control: a layer norm (mean removed) is outside the tolerance the comparison uses
    layer_norm = F.layer_norm(x, (32,), weight, None, 1e-6)
    assert (layer_norm - reference(x, weight)).abs().max() > 1e-2


def test_rms_norm_weight_carries_the_sequence_parallel_mark_of_the_config():
    assert LocalRMSNorm(tiny_config(), hidden_size=8).weight.sequence_parallel is False
    sequence_parallel = tiny_config(tensor_model_parallel_size=2, sequence_parallel=True)
    assert LocalRMSNorm(sequence_parallel, hidden_size=8).weight.sequence_parallel is True


# ---- SwiGLU --------------------------------------------------------------------------------------------------------
def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def test_swiglu_backward_is_the_derivative_of_its_forward():
    assert torch.autograd.gradcheck(swiglu, (random(4, 1, 10, seed=5).requires_grad_(),))


def test_swiglu_equals_silu_of_the_gate_half_times_the_up_half():
    x, out_weights = random(30, 1, 24, seed=6), random(30, 1, 12, seed=7)
    assert_close_in_float32(swiglu, swiglu_reference, x, weights=out_weights)
    # control: the halves swapped
    swapped = swiglu_reference(torch.cat(x.chunk(2, dim=-1)[::-1], dim=-1))
    assert (swapped - swiglu_reference(x)).abs().max() > 1e-2


@pytest.mark.parametrize("override, named", [
    (dict(gated_linear_unit=False), "gated_linear_unit=False"),
    (dict(activation_func=F.gelu), "activation_func="),
    (dict(glu_linear_offset=1.0), "glu_linear_offset=1.0"),
    (dict(activation_func_clamp_value=5.0), "activation_func_clamp_value=5.0"),
])
def test_swiglu_mlp_refuses_other_activations_and_names_the_setting(override, named):
    with pytest.raises(ValueError, match=f"SwiGLUMLP is SwiGLU without fusions; the config has {named}"):
        SwiGLUMLP(tiny_config(**override))


# ---- RoPE ----------------------------------------------------------------------------------------------------------
def test_rotation_backward_is_the_derivative_of_its_forward():
    angles = random(6, 1, 1, 8, seed=8)
    x = random(6, 2, 3, 8, seed=9).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: _rotate(x, angles.cos(), angles.sin()), (x,))


def test_rotation_equals_megatrons_rope():
    half = random(20, 1, 1, 8, seed=10)
    angles = torch.cat((half, half), dim=-1)  # megatron's layout: each frequency twice, halves repeated
    x, out_weights = random(20, 2, 3, 16, seed=11), random(20, 2, 3, 16, seed=12)

    def ours(x):
        return _rotate(x, angles.cos().to(x.dtype), angles.sin().to(x.dtype))

    def megatron(x):
        return _apply_rotary_pos_emb_bshd(x, angles.to(x.dtype))

    assert_close_in_float32(ours, megatron, x, weights=out_weights)
    # control: the rotation the other way round
    assert (_rotate(x, angles.cos(), -angles.sin()) - megatron(x)).abs().max() > 1e-2
