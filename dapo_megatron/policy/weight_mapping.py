"""THE mapping between Hugging Face (Qwen2 / Llama / Qwen3 / Qwen3-MoE) tensors and megatron-core ``GPTModel``
parameters.

One table (:data:`MAPPING_RULES`) and pure functions over it; the HF loader, the exporter, the checkpoint tools and
the SGLang handoff all go through here. Every rule says which HF tensors make one megatron parameter and how the
tensor-parallel (TP) shard of rank ``r`` of ``T`` is cut from them (:class:`Split`):

* ``REPLICATED`` — norms (the per-head q/k norms of Qwen3 too: one ``[head_dim]`` weight shared by every head),
  the MoE router: every rank holds the full tensor.
* ``ROW`` — ``linear_proj`` (o_proj), ``linear_fc2`` (down_proj): input dim split, ``W[:, r·n/T:(r+1)·n/T]``.
* ``VOCAB`` — embedding / output layer: rows padded with zeros from ``V`` to ``V_pad`` (a multiple of
  ``T × VOCAB_DIVISIBLE_BY``), then row-split; the padding is cut off again on the way back.
* ``QKV`` — ``linear_qkv`` is laid out *per query group*: for each KV head ``g`` the rows are
  ``[q heads g·Q..(g+1)·Q-1, k_g, v_g]`` (``Q`` = query heads per group, each head ``head_dim`` rows); rank ``r``
  holds groups ``r·G..(r+1)·G-1`` with ``G = num_kv_heads / T``. A plain ``cat(q, k, v)`` is wrong (max logit error
  3.8).
* ``GATE_UP`` — ``linear_fc1`` on rank ``r`` is ``cat(gate shard r, up shard r)``, NOT shard ``r`` of
  ``cat(gate, up)`` (identical at T=1, wrong at T≥2).

Mixture-of-experts layers (Qwen3-MoE): the router ``mlp.router.weight`` ← ``mlp.gate.weight``; expert ``e`` is
megatron's ``mlp.experts.local_experts.{l}`` (local spec; ``mlp.experts.linear_fc1.weight{l}`` with Transformer
Engine's grouped GEMM) on expert-parallel rank ``e // n`` with ``l = e mod n``, ``n = num_experts / EP``, and its
``linear_fc1`` / ``linear_fc2`` split over TP like a dense MLP's (``GATE_UP`` from gate_proj/up_proj, ``ROW`` from
down_proj). A rank's table holds its own experts (:func:`stage_mappings` with ``expert_parallel`` and
``expert_rank``); :func:`with_expert` rebinds one of them to the same local slot on another EP rank (the exporter).

Pipeline stages hold a contiguous run of layers; megatron names them with stage-local indices ``0..L-1`` while HF
uses global indices ``offset + i`` (:func:`stage_mappings` binds the table for one stage). With tied embeddings the
last stage (when it is not also the first) holds its own copy of the embedding as ``output_layer.weight``: it loads
from ``model.embed_tokens.weight`` and is not exported (the first stage exports the embedding).

Each rule is evaluated in two directions:
``shard_from_hf`` (full HF tensors → this rank's shard) and ``hf_from_shards`` (all ranks' shards → full HF tensors),
and ``slices_for_rank`` says which contiguous slice of each HF tensor one rank needs, so a loader can read just that.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence

import torch

from dapo_megatron.policy.model_spec import ModelSpec, padded_vocab_size


class Split(enum.Enum):
    REPLICATED = "replicated"
    ROW = "row"
    VOCAB = "vocab"
    QKV = "qkv"
    GATE_UP = "gate_up"


Placement = Literal["first_stage", "layer", "expert", "last_stage"]
Condition = Literal["always", "qkv_bias", "untied", "tied_copy", "qk_norm", "dense", "moe"]
# Symbolic HF shapes: V vocab, H hidden, Q = heads × head_dim, KV = kv_heads × head_dim, F = ffn (intermediate) size,
# D = head_dim, X = number of experts, M = one expert's ffn size, R = a LoRA adapter's rank (policy/lora/mapping.py).
Dim = Literal["V", "H", "Q", "KV", "F", "D", "X", "M", "R"]


@dataclass(frozen=True)
class MappingRule:
    """One megatron parameter and the HF tensors it is made of. ``{layer}``: stage-local (megatron) / global (HF);
    ``{expert}``: this EP rank's local expert (megatron) / the global expert (HF)."""

    megatron: str  # name with megatron's local layer spec
    megatron_te: str  # name with the Transformer Engine layer spec (fused norm + linear)
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[Dim, ...], ...]  # one symbolic shape per HF tensor
    split: Split
    placement: Placement
    condition: Condition = "always"


_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
_QKV = tuple(_H + f"self_attn.{p}_proj." for p in "qkv")
_EXPERT = _L + "mlp.experts.local_experts.{expert}."
_HF_EXPERT = _H + "mlp.experts.{expert}."

MAPPING_RULES: tuple[MappingRule, ...] = (
    MappingRule("embedding.word_embeddings.weight", "embedding.word_embeddings.weight",
                ("model.embed_tokens.weight",), (("V", "H"),), Split.VOCAB, "first_stage"),
    MappingRule(_L + "input_layernorm.weight", _L + "self_attention.linear_qkv.layer_norm_weight",
                (_H + "input_layernorm.weight",), (("H",),), Split.REPLICATED, "layer"),
    MappingRule(_L + "self_attention.linear_qkv.weight", _L + "self_attention.linear_qkv.weight",
                tuple(n + "weight" for n in _QKV), (("Q", "H"), ("KV", "H"), ("KV", "H")), Split.QKV, "layer"),
    MappingRule(_L + "self_attention.linear_qkv.bias", _L + "self_attention.linear_qkv.bias",
                tuple(n + "bias" for n in _QKV), (("Q",), ("KV",), ("KV",)), Split.QKV, "layer", "qkv_bias"),
    MappingRule(_L + "self_attention.q_layernorm.weight", _L + "self_attention.q_layernorm.weight",
                (_H + "self_attn.q_norm.weight",), (("D",),), Split.REPLICATED, "layer", "qk_norm"),
    MappingRule(_L + "self_attention.k_layernorm.weight", _L + "self_attention.k_layernorm.weight",
                (_H + "self_attn.k_norm.weight",), (("D",),), Split.REPLICATED, "layer", "qk_norm"),
    MappingRule(_L + "self_attention.linear_proj.weight", _L + "self_attention.linear_proj.weight",
                (_H + "self_attn.o_proj.weight",), (("H", "Q"),), Split.ROW, "layer"),
    MappingRule(_L + "pre_mlp_layernorm.weight", _L + "mlp.linear_fc1.layer_norm_weight",
                (_H + "post_attention_layernorm.weight",), (("H",),), Split.REPLICATED, "layer", "dense"),
    MappingRule(_L + "mlp.linear_fc1.weight", _L + "mlp.linear_fc1.weight",
                (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), (("F", "H"), ("F", "H")),
                Split.GATE_UP, "layer", "dense"),
    MappingRule(_L + "mlp.linear_fc2.weight", _L + "mlp.linear_fc2.weight",
                (_H + "mlp.down_proj.weight",), (("H", "F"),), Split.ROW, "layer", "dense"),
    # MoE layers: Transformer Engine keeps the pre-MLP norm a module of its own (nothing to fuse it into)
    MappingRule(_L + "pre_mlp_layernorm.weight", _L + "pre_mlp_layernorm.weight",
                (_H + "post_attention_layernorm.weight",), (("H",),), Split.REPLICATED, "layer", "moe"),
    MappingRule(_L + "mlp.router.weight", _L + "mlp.router.weight",
                (_H + "mlp.gate.weight",), (("X", "H"),), Split.REPLICATED, "layer", "moe"),
    MappingRule(_EXPERT + "linear_fc1.weight", _L + "mlp.experts.linear_fc1.weight{expert}",
                (_HF_EXPERT + "gate_proj.weight", _HF_EXPERT + "up_proj.weight"), (("M", "H"), ("M", "H")),
                Split.GATE_UP, "expert", "moe"),
    MappingRule(_EXPERT + "linear_fc2.weight", _L + "mlp.experts.linear_fc2.weight{expert}",
                (_HF_EXPERT + "down_proj.weight",), (("H", "M"),), Split.ROW, "expert", "moe"),
    MappingRule("decoder.final_layernorm.weight", "decoder.final_layernorm.weight",
                ("model.norm.weight",), (("H",),), Split.REPLICATED, "last_stage"),
    MappingRule("output_layer.weight", "output_layer.weight", ("lm_head.weight",), (("V", "H"),),
                Split.VOCAB, "last_stage", "untied"),
    MappingRule("output_layer.weight", "output_layer.weight", ("model.embed_tokens.weight",), (("V", "H"),),
                Split.VOCAB, "last_stage", "tied_copy"),
)


@dataclass(frozen=True)
class BoundMapping:
    """A rule bound to one pipeline stage: concrete names. ``exported`` is False for the tied output-layer copy.
    An expert's binding also knows its global expert index and where it came from (:func:`with_expert`)."""

    megatron_name: str
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[Dim, ...], ...]
    split: Split
    exported: bool = True
    expert: int | None = None  # global expert index (expert rules only)
    rule: MappingRule | None = field(default=None, compare=False, repr=False)
    hf_layer: int | None = None


@dataclass(frozen=True)
class HFSlice:
    """Rows/columns ``[start, stop)`` along ``dim`` of HF tensor ``name`` that one TP rank needs (dim None: all)."""

    name: str
    dim: int | None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class ShardGeometry:
    """One model at one TP size: everything the split depends on."""

    spec: ModelSpec
    tensor_parallel: int
    lora_rank: int = 0  # the size of dim "R" (LoRA adapters' mappings); 0: no adapters

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.spec.vocab_size, self.tensor_parallel)

    @property
    def groups_per_rank(self) -> int:
        return self.spec.num_kv_heads // self.tensor_parallel

    def size(self, dim: Dim) -> int:
        s = self.spec
        if dim == "R":
            if not self.lora_rank:
                raise ValueError("no LoRA rank given: no size for 'R'")
            return self.lora_rank
        if dim in ("X", "M"):
            if s.moe is None:
                raise ValueError(f"{s.arch} has no experts: no size for {dim!r}")
            return s.moe.num_experts if dim == "X" else s.moe.ffn_hidden_size
        return {"V": s.vocab_size, "H": s.hidden_size, "Q": s.num_attention_heads * s.head_dim,
                "KV": s.num_kv_heads * s.head_dim, "F": s.ffn_hidden_size, "D": s.head_dim}[dim]


def pipeline_layer_offset(spec: ModelSpec, pipeline_parallel: int, pipeline_rank: int) -> int:
    """Global index of the first layer of stage ``pipeline_rank`` (megatron's even split)."""
    return pipeline_rank * (spec.num_layers // pipeline_parallel)


def _applies(rule: MappingRule, spec: ModelSpec, first_stage: bool) -> bool:
    if rule.condition == "qkv_bias":
        return spec.qkv_bias
    if rule.condition == "qk_norm":
        return spec.qk_norm
    if rule.condition in ("dense", "moe"):
        return (spec.moe is not None) == (rule.condition == "moe")
    if rule.condition == "untied":
        return not spec.tie_embeddings
    if rule.condition == "tied_copy":  # PP=1 with tied embeddings has no output_layer.weight at all
        return spec.tie_embeddings and not first_stage
    return True


def _bind(rule: MappingRule, transformer_engine: bool, megatron_layer: int | None = None,
          hf_layer: int | None = None, local_expert: int | None = None, expert: int | None = None) -> BoundMapping:
    name = rule.megatron_te if transformer_engine else rule.megatron
    return BoundMapping(name.format(layer=megatron_layer, expert=local_expert),
                        tuple(h.format(layer=hf_layer, expert=expert) for h in rule.hf),
                        rule.hf_shapes, rule.split, exported=rule.condition != "tied_copy", expert=expert,
                        rule=rule, hf_layer=hf_layer)


def stage_mappings(spec: ModelSpec, *, layer_offset: int, num_local_layers: int, first_stage: bool,
                   last_stage: bool, transformer_engine: bool = False, expert_parallel: int = 1,
                   expert_rank: int = 0) -> list[BoundMapping]:
    """The table bound to one pipeline stage, in model order (embedding, layers, final norm, output layer); a MoE
    layer's experts are those of expert-parallel rank ``expert_rank`` of ``expert_parallel``, in local order."""

    def rules(placement: Placement) -> list[MappingRule]:
        return [r for r in MAPPING_RULES if r.placement == placement and _applies(r, spec, first_stage)]

    local_experts = spec.moe.num_experts // expert_parallel if spec.moe is not None else 0
    bound = [_bind(r, transformer_engine) for r in rules("first_stage")] if first_stage else []
    for local in range(num_local_layers):
        bound += [_bind(r, transformer_engine, local, layer_offset + local) for r in rules("layer")]
        for slot in range(local_experts):
            bound += [_bind(r, transformer_engine, local, layer_offset + local, slot,
                            expert_rank * local_experts + slot) for r in rules("expert")]
    if last_stage:
        bound += [_bind(r, transformer_engine) for r in rules("last_stage")]
    return bound


def with_expert(mapping: BoundMapping, expert: int) -> BoundMapping:
    """The HF names of expert ``expert`` for the same megatron parameter (the same local slot on another EP rank)."""
    if mapping.expert is None or mapping.rule is None:
        raise ValueError(f"{mapping.megatron_name} is not an expert's parameter")
    return replace(mapping, hf_names=tuple(h.format(layer=mapping.hf_layer, expert=expert) for h in mapping.rule.hf),
                   expert=expert)


def full_model_mappings(spec: ModelSpec) -> list[BoundMapping]:
    """The table for an unsplit model (PP=1, EP=1): one entry per megatron parameter of the whole model."""
    return stage_mappings(spec, layer_offset=0, num_local_layers=spec.num_layers, first_stage=True, last_stage=True)


def hf_shapes(mapping: BoundMapping, geometry: ShardGeometry) -> tuple[tuple[int, ...], ...]:
    """The full HF shape of each tensor in ``mapping.hf_names`` (for shape checks before loading)."""
    return tuple(tuple(geometry.size(d) for d in shape) for shape in mapping.hf_shapes)


def slices_for_rank(mapping: BoundMapping, geometry: ShardGeometry, tp_rank: int) -> tuple[HFSlice, ...]:
    """The contiguous slice of each HF tensor that TP rank ``tp_rank`` needs for its shard of ``mapping``."""
    t, names = geometry.tensor_parallel, mapping.hf_names
    if mapping.split is Split.REPLICATED:
        return (HFSlice(names[0], None),)
    if mapping.split is Split.VOCAB:  # may be empty: a rank can hold only padding rows
        rows, vocab = geometry.padded_vocab_size // t, geometry.spec.vocab_size
        return (HFSlice(names[0], 0, min(tp_rank * rows, vocab), min((tp_rank + 1) * rows, vocab)),)
    if mapping.split is Split.QKV:  # this rank's query groups: contiguous rows in each of q, k and v
        group_rows = [geometry.groups_per_rank * geometry.size(shape[0]) // geometry.spec.num_kv_heads
                      for shape in mapping.hf_shapes]
        return tuple(HFSlice(n, 0, tp_rank * r, (tp_rank + 1) * r) for n, r in zip(names, group_rows, strict=True))
    dim = 1 if mapping.split is Split.ROW else 0  # GATE_UP splits gate and up rows separately
    return tuple(HFSlice(n, dim, tp_rank * (geometry.size(shape[dim]) // t),
                         (tp_rank + 1) * (geometry.size(shape[dim]) // t))
                 for n, shape in zip(names, mapping.hf_shapes, strict=True))


def cut(tensor: torch.Tensor, piece: HFSlice) -> torch.Tensor:
    """Apply an :class:`HFSlice` to a full HF tensor."""
    if piece.dim is None:
        return tensor
    return tensor.narrow(piece.dim, piece.start, piece.stop - piece.start)


def assemble_shard(mapping: BoundMapping, geometry: ShardGeometry, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """This rank's megatron shard from its HF slices (as given by :func:`slices_for_rank`, in that order)."""
    if mapping.split in (Split.REPLICATED, Split.ROW):
        return pieces[0].contiguous()
    if mapping.split is Split.VOCAB:
        rows = geometry.padded_vocab_size // geometry.tensor_parallel
        piece = pieces[0]
        padding = piece.new_zeros((rows - piece.shape[0], *piece.shape[1:]))
        return torch.cat([piece, padding], dim=0)
    if mapping.split is Split.QKV:
        g, d, qpg = geometry.groups_per_rank, geometry.spec.head_dim, geometry.spec.queries_per_group
        q, k, v = pieces
        tail = q.shape[1:]
        per_group = torch.cat([q.reshape(g, qpg * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1)
        return per_group.reshape(g * (qpg + 2) * d, *tail)
    # GATE_UP: this rank's gate rows, then this rank's up rows
    return torch.cat(list(pieces), dim=0)


def split_shard(mapping: BoundMapping, geometry: ShardGeometry, shard: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of :func:`assemble_shard`: one rank's shard → its pieces of each HF tensor (padding rows kept)."""
    if mapping.split in (Split.REPLICATED, Split.ROW, Split.VOCAB):
        return [shard]
    if mapping.split is Split.QKV:
        g, d, qpg = geometry.groups_per_rank, geometry.spec.head_dim, geometry.spec.queries_per_group
        tail = shard.shape[1:]
        q, k, v = shard.reshape(g, (qpg + 2) * d, *tail).split([qpg * d, d, d], dim=1)
        return [q.reshape(g * qpg * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail)]
    return list(shard.chunk(2, dim=0))


def shard_from_hf(mapping: BoundMapping, geometry: ShardGeometry, tp_rank: int,
                  hf_tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Full HF tensors (in ``mapping.hf_names`` order) → TP rank ``tp_rank``'s megatron shard."""
    pieces = [cut(t, s) for t, s in zip(hf_tensors, slices_for_rank(mapping, geometry, tp_rank), strict=True)]
    return assemble_shard(mapping, geometry, pieces)


def hf_from_shards(mapping: BoundMapping, geometry: ShardGeometry,
                   shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """All TP ranks' shards (rank order) → the full HF tensors (in ``mapping.hf_names`` order), padding removed.
    With one rank they are views of its shard (possibly not contiguous); with several, new tensors."""
    if len(shards) != geometry.tensor_parallel:
        raise ValueError(f"{mapping.megatron_name}: got {len(shards)} shards for "
                         f"tensor_parallel={geometry.tensor_parallel}")
    if mapping.split is Split.REPLICATED:  # several HF tensors share it (a fused linear's LoRA A): each is it
        return [shards[0]] * len(mapping.hf_names)
    per_rank = [split_shard(mapping, geometry, s) for s in shards]
    if len(per_rank) == 1:  # one rank: its pieces are the tensors (views of its shard, nothing copied)
        full = per_rank[0]
    else:
        dim = 1 if mapping.split is Split.ROW else 0
        full = [torch.cat([pieces[i] for pieces in per_rank], dim=dim) for i in range(len(mapping.hf_names))]
    if mapping.split is Split.VOCAB:
        full = [full[0][: geometry.spec.vocab_size]]
    return full
