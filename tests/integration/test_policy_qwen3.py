"""Qwen3 (q/k RMSNorm per head, decoupled head_dim) and Qwen3-MoE (top-k routed experts, expert parallelism) as
megatron-core models: what the HF config becomes, the weight-mapping table's new rows, and logit parity with HF
``transformers`` (fp32) at TP×PP×EP layouts on 4 spawned gloo ranks (tiny shapes: :mod:`tiny_qwen3`).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from spawn_ranks import run_distributed
from logit_parity import TOLERANCE, megatron_logits
from tiny_models import save_random_hf_model
from tiny_qwen3 import EVEN_EXPERTS, ODD_EXPERTS, tiny_qwen3_config, tiny_qwen3_moe_config

from dapo_megatron.backend_registry import select_backend
from dapo_megatron.policy.model import transformer_config, transformer_config_arguments
from dapo_megatron.policy.model_spec import ParallelLayoutError, UnsupportedModelError, model_spec_from_hf
from dapo_megatron.policy.weight_mapping import (
    ShardGeometry,
    Split,
    full_model_mappings,
    hf_from_shards,
    hf_shapes,
    shard_from_hf,
    stage_mappings,
    with_expert,
)

# ------------------------------------------------------------------------------------------------ the spec


def test_qwen3_spec_has_qk_norm_decoupled_head_dim_and_no_bias():
    spec = model_spec_from_hf(tiny_qwen3_config())
    assert spec.arch == "qwen3" and spec.qk_norm and not spec.qkv_bias and spec.moe is None
    assert spec.head_dim == 12 and spec.hidden_size // spec.num_attention_heads == 8


def test_qwen3_moe_spec_reads_experts_and_routing():
    spec = model_spec_from_hf(tiny_qwen3_moe_config(num_experts=ODD_EXPERTS, topk=3, norm_topk_prob=False))
    assert spec.qk_norm and spec.moe is not None
    assert (spec.moe.num_experts, spec.moe.topk, spec.moe.ffn_hidden_size, spec.moe.norm_topk_prob) == (5, 3, 40, False)


@pytest.mark.parametrize("change, message", [
    (dict(mlp_only_layers=[1]), r"layers \[1\] have dense MLPs"),
    (dict(decoder_sparse_step=2), r"layers \[0, 2\] have dense MLPs"),
    (dict(num_experts_per_tok=1, norm_topk_prob=True), "num_experts_per_tok=1 with norm_topk_prob=True"),
    (dict(attention_bias=True), "attention_bias=True"),
])
def test_unsupported_qwen3_moe_variants_are_named(change, message):
    config = tiny_qwen3_moe_config()
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModelError, match=message):
        model_spec_from_hf(config)


def test_expert_parallel_must_divide_the_experts_and_needs_a_moe_model():
    backend = select_backend()
    odd = model_spec_from_hf(tiny_qwen3_moe_config(num_experts=ODD_EXPERTS))
    with pytest.raises(ParallelLayoutError, match="num_experts=5 is not divisible by expert_parallel=2"):
        transformer_config(odd, backend, tensor_parallel=1, pipeline_parallel=1, expert_parallel=2)
    with pytest.raises(ParallelLayoutError, match="needs a mixture-of-experts model"):
        transformer_config(model_spec_from_hf(tiny_qwen3_config()), backend, tensor_parallel=1, pipeline_parallel=1,
                           expert_parallel=2)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_config_routes_like_hf(norm_topk_prob):
    """HF renormalizes the top-k softmax probabilities (norm_topk_prob) = megatron's top-k of the logits, then a
    softmax over them (pre_softmax False); without renormalization: softmax first (pre_softmax True)."""
    spec = model_spec_from_hf(tiny_qwen3_moe_config(norm_topk_prob=norm_topk_prob))
    args = transformer_config_arguments(spec, tensor_parallel=1, pipeline_parallel=1, use_transformer_engine=False,
                                        cuda_available=False, expert_parallel=1, moe_aux_loss_coeff=0.01)
    assert args["moe_router_pre_softmax"] is (not norm_topk_prob)
    assert (args["num_moe_experts"], args["moe_router_topk"], args["moe_ffn_hidden_size"]) == (5, 3, 40)
    assert args["moe_router_dtype"] == "fp32" and args["moe_token_dispatcher_type"] == "alltoall"
    assert args["moe_aux_loss_coeff"] == 0.01 and args["qk_layernorm"] and not args["moe_grouped_gemm"]


# ------------------------------------------------------------------------------------------------ the mapping


def _random(mapping, geometry, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in hf_shapes(mapping, geometry)]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("moe", [False, True])
def test_qwen3_round_trip_is_bit_exact(tp, moe):
    spec = model_spec_from_hf(tiny_qwen3_moe_config() if moe else tiny_qwen3_config())
    geometry = ShardGeometry(spec, tp)
    mappings = full_model_mappings(spec)
    names = [n for m in mappings for n in m.hf_names]
    assert "model.layers.3.self_attn.q_norm.weight" in names and "model.layers.0.self_attn.k_norm.weight" in names
    assert ("model.layers.1.mlp.experts.4.down_proj.weight" in names) is moe
    for i, mapping in enumerate(mappings):
        full = _random(mapping, geometry, seed=i)
        shards = [shard_from_hf(mapping, geometry, rank, full) for rank in range(tp)]
        for original, restored in zip(full, hf_from_shards(mapping, geometry, shards), strict=True):
            assert torch.equal(restored, original), mapping.megatron_name


def test_expert_parallel_ranks_bind_their_own_experts_and_every_expert_once():
    spec = model_spec_from_hf(tiny_qwen3_moe_config(num_experts=EVEN_EXPERTS))
    ranks = [stage_mappings(spec, layer_offset=0, num_local_layers=4, first_stage=True, last_stage=True,
                            expert_parallel=2, expert_rank=rank) for rank in range(2)]
    experts = [{m.expert for m in bound if m.expert is not None} for bound in ranks]
    assert experts == [{0, 1, 2}, {3, 4, 5}]
    by_name = {m.megatron_name: m for m in ranks[1]}
    fc2 = by_name["decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert fc2.hf_names == ("model.layers.2.mlp.experts.4.down_proj.weight",) and fc2.split is Split.ROW
    fc1 = with_expert(by_name["decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"], 1)
    assert fc1.hf_names == ("model.layers.2.mlp.experts.1.gate_proj.weight",
                            "model.layers.2.mlp.experts.1.up_proj.weight")
    router = by_name["decoder.layers.0.mlp.router.weight"]
    assert router.hf_names == ("model.layers.0.mlp.gate.weight",) and router.split is Split.REPLICATED
    # Over both ranks every HF expert tensor is bound exactly once; shared tensors on each rank.
    full = {n for m in full_model_mappings(spec) for n in m.hf_names}
    expert_names = [n for bound in ranks for m in bound if m.expert is not None for n in m.hf_names]
    assert len(expert_names) == len(set(expert_names)) == len([n for n in full if ".experts." in n])


def test_transformer_engine_names_of_qk_norms_router_and_grouped_experts():
    spec = model_spec_from_hf(tiny_qwen3_moe_config())
    te = {m.megatron_name for m in stage_mappings(spec, layer_offset=0, num_local_layers=1, first_stage=True,
                                                  last_stage=True, transformer_engine=True)}
    assert {"decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
            "decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.experts.linear_fc1.weight4"} <= te


# ------------------------------------------------------------------------------------------------ parity

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)]  # (TP, PP, EP)


def _cases():
    return {
        "qwen3_untied": tiny_qwen3_config(),
        "qwen3_tied": tiny_qwen3_config(tie_word_embeddings=True),
        "qwen3_moe_5_experts_top3": tiny_qwen3_moe_config(num_experts=ODD_EXPERTS, topk=3),
        "qwen3_moe_6_experts_top2_no_renorm": tiny_qwen3_moe_config(num_experts=EVEN_EXPERTS, topk=2,
                                                                    norm_topk_prob=False),
    }


def _parity_job(cases: dict, tokens: torch.Tensor) -> dict:
    from megatron.core import parallel_state

    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec
    from dapo_megatron.policy.model import build_model

    diffs = {}
    for tp, pp, ep in LAYOUTS:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        backend = init_distributed(tp, pp, expert_parallel=ep).backend
        seed_everything(0)
        reporter = (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
                    and parallel_state.get_data_parallel_rank() == 0)
        for name, (model_dir, reference) in cases.items():
            spec = load_model_spec(model_dir)
            variants = {name: spec}
            if (tp, pp, ep) == (1, 1, 1) and spec.moe is not None:  # control: the other routing rule
                variants[name + "_CONTROL_flipped_norm_topk_prob"] = dataclasses.replace(
                    spec, moe=dataclasses.replace(spec.moe, norm_topk_prob=not spec.moe.norm_topk_prob))
            for variant, variant_spec in variants.items():
                if ep > 1 and (variant_spec.moe is None or variant_spec.moe.num_experts % ep):
                    continue
                tconfig = transformer_config(variant_spec, backend, tensor_parallel=tp, pipeline_parallel=pp,
                                             expert_parallel=ep)
                model = build_model(variant_spec, tconfig, backend).eval()
                load_hf_weights(model, variant_spec, model_dir)
                logits = megatron_logits(model, tokens % spec.vocab_size, tconfig)
                if reporter:
                    diffs[(variant, tp, pp, ep)] = (logits[..., :spec.vocab_size] - reference).abs().max().item()
    return diffs


@pytest.mark.slow
def test_logits_match_hf_at_tp_pp_ep_layouts(tmp_path):
    tokens = torch.randint(0, 10**6, (2, 12), generator=torch.Generator().manual_seed(3))
    cases = {}
    for seed, (name, config) in enumerate(_cases().items()):
        model = save_random_hf_model(tmp_path / name, config, seed=10 + seed)
        with torch.no_grad():
            cases[name] = (str(tmp_path / name), model(tokens % config.vocab_size).logits)
    diffs = {}
    for rank_diffs in run_distributed(_parity_job, 4, cases, tokens, timeout_s=900):
        diffs.update(rank_diffs)
    print("\nmax |logit diff| vs HF:", json.dumps({f"{n} TP{t}/PP{p}/EP{e}": f"{d:.2e}"
                                                   for (n, t, p, e), d in diffs.items()}))
    controls = {k: v for k, v in diffs.items() if "CONTROL" in k[0]}
    parity = {k: v for k, v in diffs.items() if "CONTROL" not in k[0]}
    assert len(controls) == 2 and all(v > 1e-2 for v in controls.values()), controls
    assert ("qwen3_moe_6_experts_top2_no_renorm", 2, 1, 2) in parity and ("qwen3_tied", 2, 2, 1) in parity
    bad = {k: v for k, v in parity.items() if not v <= TOLERANCE}
    assert not bad, f"logit parity above {TOLERANCE}: {bad}"
