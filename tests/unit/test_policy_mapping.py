"""Pure unit tests of the HF ↔ megatron weight mapping (no processes, no models).

Round trip: full HF tensors → every TP rank's shard → gathered back must be bit-exact for TP 1/2/4.
Layout: the shards must mean what megatron reads them as (per-query-group QKV, per-rank gate/up), checked by an
independent formulation; the two known mistakes (plain cat(q, k, v); splitting cat(gate, up)) must fail it.
"""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.policy.model_spec import ModelSpec
from dapo_megatron.policy.weight_mapping import (
    ShardGeometry,
    Split,
    full_model_mappings,
    hf_from_shards,
    hf_shapes,
    pipeline_layer_offset,
    shard_from_hf,
    stage_mappings,
)


def make_spec(arch="qwen2", tie=False, vocab=101, heads=12, kv=4):
    return ModelSpec(arch=arch, vocab_size=vocab, hidden_size=48, num_layers=4, num_attention_heads=heads,
                     num_kv_heads=kv, head_dim=48 // heads, ffn_hidden_size=96, rms_norm_eps=1e-6, rope_theta=1e4,
                     qkv_bias=arch == "qwen2", tie_embeddings=tie, max_position_embeddings=256)


def random_hf_tensors(mapping, geometry, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in hf_shapes(mapping, geometry)]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("llama", True)])
def test_round_trip_is_bit_exact(tp, arch, tie):
    spec = make_spec(arch, tie)
    geometry = ShardGeometry(spec, tp)
    mappings = full_model_mappings(spec)
    assert any(m.split is Split.QKV for m in mappings) and any(m.split is Split.GATE_UP for m in mappings)
    for i, mapping in enumerate(mappings):
        full = random_hf_tensors(mapping, geometry, seed=i)
        shards = [shard_from_hf(mapping, geometry, r, full) for r in range(tp)]
        assert len({s.shape for s in shards}) == 1, mapping.megatron_name
        back = hf_from_shards(mapping, geometry, shards)
        assert len(back) == len(full)
        for original, restored in zip(full, back):
            assert restored.shape == original.shape, mapping.megatron_name
            assert torch.equal(restored, original), mapping.megatron_name


def test_vocab_padding_is_zero_rows_and_ranks_may_hold_only_padding():
    spec = make_spec(vocab=101)
    geometry = ShardGeometry(spec, 4)  # padded to 512: rank 0 holds rows 0..100 + padding, ranks 1-3 only padding
    (embedding,) = [m for m in full_model_mappings(spec) if m.megatron_name == "embedding.word_embeddings.weight"]
    full = random_hf_tensors(embedding, geometry, seed=0)
    shards = [shard_from_hf(embedding, geometry, r, full) for r in range(4)]
    assert geometry.padded_vocab_size == 512 and shards[0].shape == (128, 48)
    assert torch.equal(shards[0][:101], full[0]) and not shards[0][101:].any()
    assert all(not s.any() for s in shards[1:])


# --- independent formulations of what megatron expects, and the two known mistakes -------------------------------

def expected_qkv_shard(q, k, v, spec, tp, rank):
    """Megatron reads rank r's linear_qkv as [groups, (Q q-heads, k, v), head_dim, ...] for its groups."""
    d, qpg, groups = spec.head_dim, spec.queries_per_group, spec.num_kv_heads // tp
    blocks = []
    for g in range(rank * groups, (rank + 1) * groups):
        blocks += [q[g * qpg * d:(g + 1) * qpg * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    return torch.cat(blocks)


def wrong_plain_cat_qkv(q, k, v, spec, tp, rank):
    return torch.cat([q, k, v]).chunk(tp)[rank]


def expected_fc1_shard(gate, up, spec, tp, rank):
    """Megatron's SwiGLU chunks rank r's fc1 output in two: first half gate, second half up, of r's ffn slice."""
    rows = spec.ffn_hidden_size // tp
    return torch.cat([gate[rank * rows:(rank + 1) * rows], up[rank * rows:(rank + 1) * rows]])


def wrong_split_of_cat_gate_up(gate, up, spec, tp, rank):
    return torch.cat([gate, up]).chunk(tp)[rank]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_is_interleaved_per_query_group_and_plain_cat_is_caught(tp):
    spec = make_spec(heads=12, kv=4)  # 3 query heads per group
    geometry = ShardGeometry(spec, tp)
    for mapping in [m for m in full_model_mappings(spec) if m.split is Split.QKV][:2]:  # weight and bias
        q, k, v = random_hf_tensors(mapping, geometry, seed=1)
        for rank in range(tp):
            ours = shard_from_hf(mapping, geometry, rank, [q, k, v])
            assert torch.equal(ours, expected_qkv_shard(q, k, v, spec, tp, rank))
            assert not torch.equal(wrong_plain_cat_qkv(q, k, v, spec, tp, rank),
                                   expected_qkv_shard(q, k, v, spec, tp, rank))


def test_fc1_is_per_rank_gate_then_up_and_split_of_cat_is_caught_at_tp2():
    spec = make_spec()
    (fc1,) = [m for m in full_model_mappings(spec) if m.split is Split.GATE_UP][:1]
    gate, up = random_hf_tensors(fc1, ShardGeometry(spec, 1), seed=2)
    for tp in (1, 2, 4):
        geometry = ShardGeometry(spec, tp)
        for rank in range(tp):
            assert torch.equal(shard_from_hf(fc1, geometry, rank, [gate, up]),
                               expected_fc1_shard(gate, up, spec, tp, rank))
    # The mistake is invisible at TP=1 and visible at TP=2 — why parity tests must run at TP >= 2.
    assert torch.equal(wrong_split_of_cat_gate_up(gate, up, spec, 1, 0), expected_fc1_shard(gate, up, spec, 1, 0))
    assert not torch.equal(wrong_split_of_cat_gate_up(gate, up, spec, 2, 0), expected_fc1_shard(gate, up, spec, 2, 0))


def test_row_parallel_splits_input_dim():
    spec = make_spec()
    geometry = ShardGeometry(spec, 2)
    (o_proj,) = [m for m in full_model_mappings(spec)
                 if m.megatron_name == "decoder.layers.0.self_attention.linear_proj.weight"]
    (w,) = random_hf_tensors(o_proj, geometry, seed=3)
    assert torch.equal(shard_from_hf(o_proj, geometry, 1, [w]), w[:, w.shape[1] // 2:])


def test_pipeline_stages_bind_global_hf_layers_and_tied_copy():
    spec = make_spec("llama", tie=True)
    assert pipeline_layer_offset(spec, 2, 1) == 2
    first = stage_mappings(spec, layer_offset=0, num_local_layers=2, first_stage=True, last_stage=False)
    last = stage_mappings(spec, layer_offset=2, num_local_layers=2, first_stage=False, last_stage=True)
    by_name = {m.megatron_name: m for m in last}
    assert by_name["decoder.layers.0.mlp.linear_fc2.weight"].hf_names == ("model.layers.2.mlp.down_proj.weight",)
    assert "embedding.word_embeddings.weight" in {m.megatron_name for m in first}
    tied_copy = by_name["output_layer.weight"]
    assert tied_copy.hf_names == ("model.embed_tokens.weight",) and not tied_copy.exported
    # Over both stages each exported HF name appears once and equals the unsplit model's set.
    exported = [n for m in first + last if m.exported for n in m.hf_names]
    assert len(exported) == len(set(exported))
    assert set(exported) == {n for m in full_model_mappings(spec) for n in m.hf_names}
    assert "lm_head.weight" not in exported and all("bias" not in n for n in exported)  # llama: no qkv bias
    # PP=1 with tied embeddings: megatron has no output_layer.weight at all.
    assert "output_layer.weight" not in {m.megatron_name for m in full_model_mappings(spec)}


def test_transformer_engine_names_fuse_norms_into_linears():
    spec = make_spec()
    te = {m.megatron_name for m in stage_mappings(spec, layer_offset=0, num_local_layers=1, first_stage=True,
                                                  last_stage=True, transformer_engine=True)}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in te)
