"""One decode step of the embedded engine's HF model as plain torch calls on its own parameters.

A decode step runs the model on one token per row. Through ``model(...)`` that is about 150 module calls and
transformers' per-call machinery (output capturing, kwargs merging, mask preparation, cache bookkeeping), which on
the CPU demo's ~1M-parameter model costs more than the arithmetic. :class:`LeanDecoder` performs the model's
operations in the model's order on the same tensors — embedding, RMSNorm, q/k/v projections, RoPE from the model's
own rotary module, the cache write, attention, o-projection, SwiGLU MLP, final norm, LM head — for the Qwen2 /
Llama / Qwen3 decoder layout (Qwen3: each query and key head RMS-normalized before RoPE) with dense MLPs.
A mixture-of-experts model (Qwen3-MoE) decodes through :class:`ModelDecodeStep`, the model's own forward on the same
cache: routing is data-dependent and its forward is HF's reference (:func:`decode_step_for` picks).

Three steps are written differently, each to cut the number of small torch calls a step makes: q/k/v are one
projection and gate/up another (their weights concatenated once and rebuilt when a weight update writes them), RoPE
rotates queries and keys in one call, and attention with one query per row is two small matmuls and a softmax over
the row's keys, each query head grouped with its key/value head (about half the cost of torch's CPU SDPA kernel
under a mask). The logits equal the model's up to float rounding (tests/unit/test_rollout_embedded.py compares them).

The prompt (prefill) still goes through ``model(...)``: it is one call per chunk, and it fills the same KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache


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


def _head_norm(heads: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """Qwen3's per-head q/k RMSNorm (weights ``[head_dim]``) of ``heads [B, H, 1, D]``."""
    return _rms_norm(heads, norm.weight, norm.variance_epsilon)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _one_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_bias: torch.Tensor,
                         scaling: float) -> torch.Tensor:
    """Attention of ``query [B, Hq, 1, D]`` over ``key``/``value [B, Hkv, L, D]`` with ``key_bias [B, 1, 1, L]`` (0 or
    -inf) added to the scores; query head ``h`` reads key/value head ``h // (Hq / Hkv)`` (transformers' GQA layout).
    Returns ``[B, Hkv, Hq / Hkv, D]``, heads in query order."""
    batch, kv_heads = key.shape[0], key.shape[1]
    grouped = query.reshape(batch, kv_heads, -1, query.shape[-1])  # [B, Hkv, group, D]
    scores = torch.matmul(grouped, key.transpose(-1, -2)) * scaling + key_bias
    return torch.matmul(torch.softmax(scores, dim=-1), value)


class _Concatenated:
    """``torch.cat(parts)`` of some parameters (None: no such parameter), rebuilt when one of them was written since
    the last build: an in-place write (a weight update's ``copy_``) moves a tensor's version counter."""

    def __init__(self, parts: list[torch.Tensor | None]) -> None:
        self.parts = parts if all(part is not None for part in parts) else None
        self.stamp: tuple | None = None
        self.value: torch.Tensor | None = None

    def get(self) -> torch.Tensor | None:
        if self.parts is None:
            return None
        stamp = tuple((part.data_ptr(), part._version) for part in self.parts)
        if stamp != self.stamp:
            self.stamp, self.value = stamp, torch.cat(self.parts)
        return self.value


def has_dense_mlps(model: torch.nn.Module) -> bool:
    """Whether every layer's MLP is one SwiGLU (gate/up/down projections), the layout :class:`LeanDecoder` runs."""
    return all(hasattr(layer.mlp, "gate_proj") for layer in model.model.layers)


def decode_step_for(model: torch.nn.Module):
    """The decode step for ``model``: :class:`LeanDecoder` for dense MLPs, else :class:`ModelDecodeStep`."""
    return LeanDecoder(model) if has_dense_mlps(model) else ModelDecodeStep(model)


class ModelDecodeStep:
    """A decode step through ``model(...)`` itself (the generic path: any decoder ``transformers`` builds), with the
    same inputs and cache as :class:`LeanDecoder`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 cache: Cache) -> torch.Tensor:
        return self.model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=position_ids,
                          cache=cache, use_cache=True).logits[:, -1]


class LeanDecoder:
    """Decode steps of ``model`` (a Qwen2ForCausalLM / LlamaForCausalLM / Qwen3ForCausalLM with SDPA attention),
    reading its parameters as they are at each call (weight updates need no rebuild)."""

    def __init__(self, model: torch.nn.Module) -> None:
        if model.config._attn_implementation != "sdpa":
            raise ValueError(f"LeanDecoder follows the SDPA attention path, the model uses "
                             f"{model.config._attn_implementation!r}")
        if not has_dense_mlps(model):
            raise ValueError("LeanDecoder runs dense SwiGLU MLPs; a mixture-of-experts model decodes through "
                             "ModelDecodeStep")
        self.model = model
        self.base = model.model
        self.fused = []  # per layer: q/k/v weight and bias, gate/up weight and bias
        attn = self.base.layers[0].self_attn
        self.query_heads = attn.q_proj.weight.shape[0] // attn.head_dim
        self.rotated_heads = self.query_heads + attn.k_proj.weight.shape[0] // attn.head_dim  # queries, then keys
        for layer in self.base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
            self.fused.append([_Concatenated([getattr(linear, name) for linear in group])
                               for group in projections for name in ("weight", "bias")])

    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 cache: Cache) -> torch.Tensor:
        """Logits ``[B, V]`` of the next token after ``tokens [B]`` at ``position_ids [B, 1]``, attending to the
        cache slots ``attention_mask [B, 1, 1, L]`` allows; writes the new keys/values into ``cache``."""
        base = self.base
        hidden = F.embedding(tokens[:, None], base.embed_tokens.weight, base.embed_tokens.padding_idx)
        cos, sin = base.rotary_emb(hidden, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        batch = hidden.shape[0]
        key_bias = torch.zeros(attention_mask.shape, dtype=hidden.dtype, device=hidden.device).masked_fill_(
            ~attention_mask, float("-inf"))
        query_heads, rotated = self.query_heads, self.rotated_heads
        for index, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_weight, qkv_bias, gate_up_weight, gate_up_bias = (part.get() for part in self.fused[index])
            residual = hidden
            hidden = _rms_norm(hidden, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            qkv = F.linear(hidden, qkv_weight, qkv_bias).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
            query_key = qkv[:, :rotated]
            if hasattr(attn, "q_norm"):  # Qwen3: each head RMS-normalized before RoPE
                query_key = torch.cat([_head_norm(query_key[:, :query_heads], attn.q_norm),
                                       _head_norm(query_key[:, query_heads:], attn.k_norm)], dim=1)
            query_key = (query_key * cos) + (_rotate_half(query_key) * sin)
            key, value = cache.layers[index].update(query_key[:, query_heads:], qkv[:, rotated:])
            context = _one_query_attention(query_key[:, :query_heads], key, value, key_bias, attn.scaling)
            hidden = residual + F.linear(context.reshape(batch, 1, -1), attn.o_proj.weight, attn.o_proj.bias)
            residual = hidden
            hidden = _rms_norm(hidden, layer.post_attention_layernorm.weight,
                               layer.post_attention_layernorm.variance_epsilon)
            gate, up = F.linear(hidden, gate_up_weight, gate_up_bias).chunk(2, dim=-1)
            hidden = residual + F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        hidden = _rms_norm(hidden, base.norm.weight, base.norm.variance_epsilon)
        return F.linear(hidden[:, -1], self.model.lm_head.weight, self.model.lm_head.bias)
