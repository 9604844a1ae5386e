"""Core attention of the CPU backend's layer spec (:mod:`dapo_megatron.cpu.layers`), at a cost per sample.

megatron-core's local ``DotProductAttention`` has no packed-sequence support: a row holding several samples had to
be one dense ``S × S`` score matrix with a block-diagonal causal mask, so attention grew with the square of the row
and rows had to stay short (many micro-batches, each paying megatron's per-layer Python work). It also rotates
queries and keys (RoPE) by their position in the row, not in their sample.

:class:`PackedSequenceAttention` is that module with RoPE moved inside it and a packed layout of its own, the
``"segments"`` layout (:class:`SegmentedRow`, built by :mod:`dapo_megatron.cpu.segment_packing`):

* a row holds *views*: a view is the row positions of one sample in order — its prompt, then its response. Views
  may share positions: every response to the same prompt reads the prompt's positions, so a prompt is embedded,
  projected and run through the MLPs once per row instead of once per sample;
* each token is rotated by its position in its sample (``positions``), as the rollout engine rotates it;
* attention gathers the views into right-padded batches ``[views, heads, longest, head_dim]`` — one per length
  class (views at least half as long as the class's longest), so a short response is not padded to the longest
  one in the row — runs causal attention on each (``longest²`` per view instead of ``row²``; explicit scores for a
  small class, SDPA's flash kernel for a large one) and takes each row position's output from the one view that
  owns it (``slot``). Right padding is never seen by a real query (causal), padded queries see real keys only (so
  every value stays finite) and are dropped; a prompt shared by several views gets its key/value gradient from all
  of them through the gather.

The result equals the dense masked computation of each sample alone up to float rounding
(tests/integration/test_cpu_attention.py). Without ``packed_seq_params`` (right-padded rows or a dense mask, the
baselines of ``bench/baseline_packing.py``) the module rotates by row position and runs megatron's
``DotProductAttention`` unchanged: megatron's own path, up to
the rounding of the rotation's fused multiply-adds (:class:`_Rotate`).

Models built with this module use ``position_embedding_type="none"`` (the CPU backend's ``rope_in_attention``):
megatron's own RoPE would rotate by row position before the core attention sees the tensors. Its rotary embedding
holds no weights, so the checkpoint layout is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor

from dapo_megatron.policy.sdpa_attention import unsupported_by_packed_attention


@dataclass(frozen=True)
class RotarySettings:
    """RoPE as the HF config gives it: base and the llama3 scaling factor (None: plain RoPE)."""

    base: float
    llama3_factor: float | None = None


@dataclass
class SegmentedRow(PackedSeqParams):
    """``packed_seq_params`` of one packed row in the ``"segments"`` layout (``qkv_format`` stays megatron's "sbhd":
    the tensors keep their ``[s, b=1, ...]`` shape through megatron's attention).

    ``positions [S]``: each token's position in its sample (RoPE); ``classes``: ``(views, longest)`` of each length
    class; ``gather [Σ views × longest]``: the row position each padded view slot reads, class after class (slots
    past a view's end repeat its first position); ``slot [S]``: the slot, in that same order, whose output each row
    position takes.
    """

    classes: tuple[tuple[int, int], ...] = ()
    positions: Tensor | None = None
    gather: Tensor | None = None
    slot: Tensor | None = None
    _head_rows: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.qkv_format = "sbhd"

    def head_rows(self, heads: int, kv_heads: int) -> "_HeadRows":
        """The gathers of :class:`_HeadRows` for this row and these head counts (built once, shared by every layer)."""
        if (heads, kv_heads) not in self._head_rows:
            self._head_rows[heads, kv_heads] = _HeadRows.build(self, heads, kv_heads)
        return self._head_rows[heads, kv_heads]


@dataclass(frozen=True)
class _HeadRows:
    """Flat-row gathers that build each length class's batch straight in SDPA's ``[views, heads, longest, d]``
    layout from the row's ``[S·heads, d]`` queries and ``[S·kv_heads, d]`` keys/values, and take each row position's
    output back from the classes' concatenated contexts: one gather each way, no transposes.

    ``queries[c]`` / ``keys[c]``: for class ``c``, the flat query / key-value row of each (view, head, slot);
    ``outputs [S·heads]``: the flat context row of each (row position, head)."""

    queries: tuple[Tensor, ...]
    keys: tuple[Tensor, ...]
    outputs: Tensor

    @classmethod
    def build(cls, row: SegmentedRow, heads: int, kv_heads: int) -> "_HeadRows":
        device = row.gather.device
        head, kv_head = torch.arange(heads, device=device), torch.arange(kv_heads, device=device)
        queries, keys, output_base, output_stride = [], [], [], []
        slot_start = context_start = 0
        for views, longest in row.classes:
            tokens = row.gather[slot_start:slot_start + views * longest].view(views, 1, longest)
            queries.append((tokens * heads + head[:, None]).reshape(-1))
            keys.append((tokens * kv_heads + kv_head[:, None]).reshape(-1))
            # slot (view v, position l) of this class: head h's context row is base + h·longest
            view_and_position = torch.arange(views * longest, device=device)
            view, position = view_and_position // longest, view_and_position % longest
            output_base.append(context_start + view * heads * longest + position)
            output_stride.append(torch.full((views * longest,), longest, device=device))
            slot_start += views * longest
            context_start += views * heads * longest
        base, stride = torch.cat(output_base)[row.slot], torch.cat(output_stride)[row.slot]
        return cls(tuple(queries), tuple(keys), (base[:, None] + head[None, :] * stride[:, None]).reshape(-1))


class _Rotate(torch.autograd.Function):
    """megatron's non-interleaved RoPE (``_apply_rotary_pos_emb_bshd``): ``x·cos + [-x₂, x₁]·sin``, halves
    ``x₁``/``x₂`` of the last dimension. Forward and backward are two passes each (a product, then a multiply-add
    per half) where autograd's op-by-op version makes about ten (negation, concatenation, their backward)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        grad_x = grad * cos
        grad_x[..., :half].addcmul_(grad[..., half:], sin[..., half:])
        grad_x[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1)
        return grad_x, None, None


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _Rotate.apply(x, cos, sin)


class _Rotation:
    """cos/sin tables ``[positions, 1, 1, head_dim]`` from megatron's RotaryEmbedding, grown on demand; and the
    per-token tables of the row seen last (one entry: every layer of a forward pass passes the same row object)."""

    def __init__(self, rotary: RotaryEmbedding) -> None:
        self.rotary = rotary
        self.cos = self.sin = None
        self.row: SegmentedRow | None = None
        self.row_tables: tuple[Tensor, Tensor] | None = None

    def tables(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.cos is None or self.cos.shape[0] < length or self.cos.device != device or self.cos.dtype != dtype:
            freqs = self.rotary.get_emb(max(length, 64)).to(device)  # [L, 1, 1, d]
            self.cos, self.sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
        return self.cos[:length], self.sin[:length]

    def for_row(self, row: SegmentedRow, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.row is not row:
            cos, sin = self.tables(int(row.positions.max()) + 1, row.positions.device, dtype)
            self.row, self.row_tables = row, (cos[row.positions, 0], sin[row.positions, 0])  # [S, 1, d]
        return self.row_tables


# Largest score matrix (views × heads × longest², fp32 elements: 16 MiB) a length class computes explicitly; larger
# classes take SDPA's flash kernel, which never holds the scores.
EXPLICIT_SCORES_MAX = 1 << 22


def causal_attention_flash(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """:func:`causal_attention_explicit` through SDPA's flash kernel (no score matrix held)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def causal_attention_explicit(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention of ``q [n, h, L, d]`` over ``k``, ``v [n, g, L, d]`` (query head ``i`` reads key/value head
    ``i // (h / g)``) as two batched matmuls and a softmax, each key/value head's query heads stacked into one
    matrix: on short views torch's CPU flash kernel costs ~1.6× this, forward and backward. Returns ``[n, h, L, d]``."""
    n, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
    causal_bias = torch.zeros(length, length, dtype=q.dtype, device=q.device).masked_fill_(future, float("-inf"))
    scores = torch.baddbmm(causal_bias.repeat(group, 1).expand(n * kv_heads, -1, -1),
                           q.reshape(n * kv_heads, group * length, dim),
                           k.reshape(n * kv_heads, length, dim).transpose(1, 2), alpha=scale)
    context = torch.bmm(torch.softmax(scores, dim=-1), v.reshape(n * kv_heads, length, dim))
    return context.view(n, heads, length, dim)


class PackedSequenceAttention(DotProductAttention):
    """megatron's ``DotProductAttention`` with RoPE inside it and the ``"segments"`` packed layout (see the module
    docstring)."""

    def __init__(self, config, *args, rotary: RotarySettings, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        # megatron's dense path multiplies the scores by softmax_scale, then by the softmax's own scale (the layer
        # number under query-key layer scaling): the packed path applies both at once.
        self.packed_scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        self._rotation = _Rotation(RotaryEmbedding(
            kv_channels=config.kv_channels, rotary_percent=1.0, rotary_interleaved=False,
            rotary_base=rotary.base, rope_scaling=rotary.llama3_factor is not None,
            rope_scaling_factor=rotary.llama3_factor or 8.0, use_cpu_initialization=True))
        if config.rotary_interleaved:
            raise ValueError("PackedSequenceAttention: interleaved RoPE is not supported")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if packed_seq_params is None:  # right-padded or dense-mask rows: rotate by row position, megatron's path
            cos, sin = self._rotation.tables(query.shape[0], query.device, query.dtype)
            return super().forward(_rotate(query, cos, sin), _rotate(key, cos, sin), value, attention_mask,
                                   attn_mask_type=attn_mask_type, attention_bias=attention_bias)
        row = packed_seq_params
        self._check_packed(row, query, attention_bias)
        cos, sin = self._rotation.for_row(row, query.dtype)
        query, key, value = _rotate(query[:, 0], cos, sin), _rotate(key[:, 0], cos, sin), value[:, 0]
        tokens, heads, head_dim = query.shape
        kv_heads = key.shape[1]
        rows = row.head_rows(heads, kv_heads)
        query, key, value = (x.reshape(-1, head_dim) for x in (query, key, value))  # [S·heads, d], [S·kv_heads, d]

        contexts = []
        for (views, longest), query_rows, key_rows in zip(row.classes, rows.queries, rows.keys):
            q = query.index_select(0, query_rows).view(views, heads, longest, head_dim)
            k, v = (x.index_select(0, key_rows).view(views, kv_heads, longest, head_dim) for x in (key, value))
            attention = (causal_attention_explicit if views * heads * longest * longest <= EXPLICIT_SCORES_MAX
                         else causal_attention_flash)
            contexts.append(attention(q, k, v, self.packed_scale).reshape(-1, head_dim))
        context = contexts[0] if len(contexts) == 1 else torch.cat(contexts)
        return context.index_select(0, rows.outputs).view(tokens, 1, heads * head_dim)  # [S, 1, hp]

    def _check_packed(self, row, query: Tensor, attention_bias) -> None:
        unsupported = []
        if not isinstance(row, SegmentedRow):
            unsupported.append(f"packed_seq_params of type {type(row).__name__} (only SegmentedRow)")
        elif query.shape[1] != 1 or row.slot.numel() != query.shape[0]:
            unsupported.append(f"a query of shape {tuple(query.shape)} for a row of {row.slot.numel()} tokens")
        unsupported += unsupported_by_packed_attention(self, attention_bias)
        if unsupported:
            raise ValueError("PackedSequenceAttention does not support " + ", ".join(unsupported))

