"""Core attention for CUDA without Transformer Engine: megatron's local layer spec, torch's fused SDPA per sample.

megatron-core's own local ``DotProductAttention`` refuses packed rows (``packed_seq_params``) and would otherwise
attend over the whole row with a dense ``S × S`` mask. :class:`ThdSdpaAttention` takes the same THD rows Transformer
Engine takes (:class:`dapo_megatron.policy.packing.ThdPacker`): megatron's attention module has already dropped the
batch dimension and rotated each sample's queries and keys from position 0 (RoPE with ``cu_seqlens``), so each sample
is a contiguous ``[L, heads, d]`` slice, and ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``
runs on it — on CUDA the flash or memory-efficient kernel, which never holds the scores. Grouped-query attention
reads each key/value head for its query heads (``enable_gqa``) without repeating them.

Samples of the same length run as one batch; the boundaries come from the row's ``segment_lengths`` (host-side, so
no layer waits for the device to read ``cu_seqlens``). The result equals megatron's dense masked attention of each
sample alone up to float rounding (tests/integration/test_backend.py runs it on CPU against the HF model).
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

from dapo_megatron.policy.packing import ThdRow


class ThdSdpaAttention(DotProductAttention):
    """megatron's ``DotProductAttention`` for THD packed rows, by SDPA per sample (see the module docstring)."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        # megatron's dense path multiplies the scores by softmax_scale, then by the softmax's own scale (the layer
        # number under query-key layer scaling): SDPA applies both at once.
        self.sdpa_scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        self._check(packed_seq_params, query, attention_bias)
        lengths = packed_seq_params.segment_lengths
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        by_length: dict[int, list[int]] = defaultdict(list)
        for number, length in enumerate(lengths):
            by_length[length].append(number)
        heads, head_dim = query.shape[1], query.shape[2]
        output = query.new_empty(query.shape[0], heads, head_dim)
        for length, numbers in by_length.items():
            rows = [slice(starts[n], starts[n] + length) for n in numbers]
            q, k, v = (torch.stack([x[r] for r in rows]).transpose(1, 2) for x in (query, key, value))  # [n, h, L, d]
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.sdpa_scale,
                                                     enable_gqa=k.shape[1] != q.shape[1]).transpose(1, 2)
            for row, part in zip(rows, context):
                output[row] = part
        return output.view(query.shape[0], heads * head_dim)  # megatron reshapes THD output to [t, 1, h·d]

    def _check(self, params, query: Tensor, attention_bias) -> None:
        unsupported = []
        if not isinstance(params, ThdRow) or params.qkv_format != "thd":
            unsupported.append(f"packed_seq_params of type {type(params).__name__} (only a THD row of ThdPacker)")
        elif query.dim() != 3 or sum(params.segment_lengths) != query.shape[0]:
            unsupported.append(f"a query of shape {tuple(query.shape)} for a row of {sum(params.segment_lengths)} "
                               f"tokens")
        unsupported += unsupported_by_packed_attention(self, attention_bias)
        if unsupported:
            raise ValueError("ThdSdpaAttention does not support " + ", ".join(unsupported))


def unsupported_by_packed_attention(module: DotProductAttention, attention_bias) -> list[str]:
    """What ``module``'s configuration asks of attention that the per-sample packed paths (this one and the CPU
    backend's) do not compute: they would silently compute something else."""
    unsupported = []
    if attention_bias is not None:
        unsupported.append("an attention bias")
    if module.scale_mask_softmax.window_size is not None:
        unsupported.append("sliding-window attention")
    if module.softmax_offset is not None:
        unsupported.append(f"softmax_type={module.config.softmax_type!r}")
    if module.training and module.attention_dropout.p > 0:
        unsupported.append(f"attention dropout {module.attention_dropout.p}")
    return unsupported


def sdpa_layer_spec(*, qk_norm: bool = False, num_experts: int | None = None) -> ModuleSpec:
    """megatron's local GPT layer spec (RMSNorm) with :class:`ThdSdpaAttention` as its core attention; with per-head
    q/k RMSNorm (``qk_norm``, megatron's ``qk_layernorm``) and megatron's MoE layer with its sequential experts
    (``num_experts``) when the model has them."""
    layer = copy.deepcopy(get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                   qk_layernorm=qk_norm, normalization="RMSNorm"))
    layer.submodules.self_attention.submodules.core_attention = ThdSdpaAttention
    return layer
