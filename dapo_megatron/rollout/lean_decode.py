"""One decode step of the embedded engine's HF model as plain torch calls on its own parameters.

A decode step runs the model on one token per row. Through ``model(...)`` that is about 150 module calls and
transformers' per-call machinery (output capturing, kwargs merging, mask preparation, cache bookkeeping), which on
the CPU demo's ~1M-parameter model costs more than the arithmetic. :class:`LeanDecoder` performs the same
operations in the same order on the same tensors — embedding, RMSNorm, q/k/v projections, RoPE from the model's own
rotary module, the cache write, transformers' own SDPA attention function, o-projection, SwiGLU MLP, final norm,
LM head — so its logits are bit-identical to the model's (tests/test_rollout_embedded.py checks it), for the
Qwen2 / Llama decoder layout :func:`dapo_megatron.rollout.embedded.check_supported_config` admits.

The prompt (prefill) still goes through ``model(...)``: it is one call per chunk, and it fills the same KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen2RMSNorm / LlamaRMSNorm forward: ``weight * (x * rsqrt(mean(x²) + eps))`` in float32, which
    is torch's ``rms_norm`` operation for operation (one call instead of seven). Other dtypes take transformers'
    steps as they are (float32 statistics, cast back before the weight)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecoder:
    """Decode steps of ``model`` (a Qwen2ForCausalLM / LlamaForCausalLM with SDPA attention), reading its
    parameters as they are at each call (weight updates need no rebuild)."""

    def __init__(self, model: torch.nn.Module) -> None:
        if model.config._attn_implementation != "sdpa":
            raise ValueError(f"LeanDecoder follows the SDPA attention path, the model uses "
                             f"{model.config._attn_implementation!r}")
        self.model = model
        self.base = model.model

    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 cache: Cache) -> torch.Tensor:
        """Logits ``[B, V]`` of the next token after ``tokens [B]`` at ``position_ids [B, 1]``, attending to the
        cache slots ``attention_mask [B, 1, 1, L]`` allows; writes the new keys/values into ``cache``."""
        base = self.base
        hidden = F.embedding(tokens[:, None], base.embed_tokens.weight, base.embed_tokens.padding_idx)
        cos, sin = base.rotary_emb(hidden, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        batch = hidden.shape[0]
        for index, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            residual = hidden
            hidden = _rms_norm(hidden, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            shape = (batch, 1, -1, attn.head_dim)
            query = F.linear(hidden, attn.q_proj.weight, attn.q_proj.bias).view(shape).transpose(1, 2)
            key = F.linear(hidden, attn.k_proj.weight, attn.k_proj.bias).view(shape).transpose(1, 2)
            value = F.linear(hidden, attn.v_proj.weight, attn.v_proj.bias).view(shape).transpose(1, 2)
            query = (query * cos) + (_rotate_half(query) * sin)
            key = (key * cos) + (_rotate_half(key) * sin)
            key, value = cache.layers[index].update(key, value)
            context, _ = sdpa_attention_forward(attn, query, key, value, attention_mask, dropout=0.0,
                                                scaling=attn.scaling, sliding_window=None)
            context = context.reshape(batch, 1, -1).contiguous()
            hidden = residual + F.linear(context, attn.o_proj.weight, attn.o_proj.bias)
            residual = hidden
            hidden = _rms_norm(hidden, layer.post_attention_layernorm.weight,
                               layer.post_attention_layernorm.variance_epsilon)
            gate = mlp.act_fn(F.linear(hidden, mlp.gate_proj.weight, mlp.gate_proj.bias))
            hidden = residual + F.linear(gate * F.linear(hidden, mlp.up_proj.weight, mlp.up_proj.bias),
                                         mlp.down_proj.weight, mlp.down_proj.bias)
        hidden = _rms_norm(hidden, base.norm.weight, base.norm.variance_epsilon)
        return F.linear(hidden[:, -1], self.model.lm_head.weight, self.model.lm_head.bias)
