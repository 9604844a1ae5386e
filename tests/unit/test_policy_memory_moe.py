"""The memory plan of Qwen3 and Qwen3-MoE (policy/memory/gpu.py): parameter counts equal to the published totals,
experts sharded over expert parallelism (weights over EP, optimizer state over the expert-data-parallel group), a
hand-computed small MoE, and `dapo-megatron plan` for Qwen3-8B, Qwen3-30B-A3B on one node of 8 × 80 GB and
Qwen3-235B-A22B on 16 nodes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dapo_megatron.policy.memory.gpu import estimate_memory, layer_parameters, moe_layer_parameters
from dapo_megatron.policy.model_spec import ModelSpec, MoESpec, model_spec_from_hf, padded_vocab_size
from dapo_megatron.policy.shapes import published_hf_config

REPO = Path(__file__).resolve().parents[2]
SMALL_MOE = ModelSpec(arch="qwen3_moe", vocab_size=101, hidden_size=64, num_layers=4, num_attention_heads=8,
                      num_kv_heads=2, head_dim=16, ffn_hidden_size=128, rms_norm_eps=1e-6, rope_theta=1e4,
                      qkv_bias=False, tie_embeddings=False, max_position_embeddings=256, qk_norm=True,
                      moe=MoESpec(num_experts=6, topk=2, ffn_hidden_size=32, norm_topk_prob=True))


@pytest.mark.parametrize("name, billions", [("Qwen3-8B", 8.19), ("Qwen3-30B-A3B", 30.53), ("Qwen3-235B-A22B", 235.09)])
def test_parameter_counts_are_the_published_totals(name, billions):
    spec = model_spec_from_hf(published_hf_config(name))
    layers = spec.num_layers * (layer_parameters(spec, 1) + moe_layer_parameters(spec, 1, 1))
    total = layers + 2 * padded_vocab_size(spec.vocab_size, 1) * spec.hidden_size + spec.hidden_size
    assert total / 1e9 == pytest.approx(billions, abs=0.01)


def test_small_moe_by_hand():
    """h 64, q 128, k 32, head_dim 16, 6 experts of M 32, top-2; TP 2, PP 1, DP 4, EP 2; 100 tokens, bf16, no SP.

    Layer besides experts per TP rank: ((128+64)·64 + 128·64) / 2 + 2·64 + 2·16 (q/k norms) + 6·64 (router) = 10784.
    Experts per rank: 3 experts · 3·32·64 / 2 = 9216. Embedding / output 256·64/2 = 8192.
    Activations per token per layer: 4·64 + (128+64+128)/2 + 2·(2·64 + 3·32/2) = 768 values (and the last stage's
    2·64 more).
    """
    (stage,) = estimate_memory(SMALL_MOE, tensor_parallel=2, pipeline_parallel=1, data_parallel=4, expert_parallel=2,
                               micro_batch_tokens=100, recompute="none", sequence_parallel=False)
    experts, dense = 4 * 9216, 4 * 10784 + 2 * 8192 + 64
    assert stage.parameters == experts + dense
    assert stage.optimizer_bytes == int(dense * 12 / 4 + experts * 12 / 2)  # experts: sharded over DP / EP = 2
    assert stage.activations_bytes == (4 * 768 + 2 * 64) * 100 * 2  # + the final norm's and output layer's inputs


def test_expert_parallelism_splits_the_experts_and_their_optimizer_state():
    one, two = (estimate_memory(SMALL_MOE, tensor_parallel=1, pipeline_parallel=1, data_parallel=2,
                                expert_parallel=ep, micro_batch_tokens=100)[0] for ep in (1, 2))
    experts = 4 * 6 * 3 * 32 * 64
    assert one.parameters - two.parameters == experts // 2
    # EP=1 shards every expert's optimizer state over DP=2; EP=2 holds half the experts, each unsharded: the same
    assert one.optimizer_bytes == two.optimizer_bytes
    assert one.grads_bytes - two.grads_bytes == experts // 2 * 4
    dense = dataclasses.replace(SMALL_MOE, moe=None, arch="qwen3")
    with pytest.raises(ValueError, match="expert_parallel"):
        estimate_memory(SMALL_MOE, tensor_parallel=1, pipeline_parallel=1, data_parallel=3, expert_parallel=2,
                        micro_batch_tokens=100)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        estimate_memory(dense, tensor_parallel=1, pipeline_parallel=1, data_parallel=2, expert_parallel=2,
                        micro_batch_tokens=100)


PLANS = [  # (model, TP, PP, EP, DP, micro-batch tokens, recompute, fits 80 GB)
    ("Qwen3-8B", 2, 1, 1, 4, 8192, "selective", True),  # one node
    ("Qwen3-30B-A3B", 2, 1, 4, 4, 4096, "full", True),  # one node of 8 GPUs
    ("Qwen3-30B-A3B", 1, 1, 8, 8, 4096, "full", False),  # the same node without TP: the dense part unsplit
    ("Qwen3-235B-A22B", 4, 2, 16, 16, 8192, "full", True),  # 16 nodes x 8 GPUs
]


@pytest.mark.parametrize("name, tp, pp, ep, dp, tokens, recompute, fits", PLANS)
def test_plan_command_for_the_qwen3_family(name, tp, pp, ep, dp, tokens, recompute, fits, capsys):
    from dapo_megatron.cli import main

    code = main(["plan", str(REPO / "examples" / "dapo_qwen2.5_32b.yaml"), f"model.hf_path=/models/{name}-Instruct",
                 f"parallel.tensor={tp}", f"parallel.pipeline={pp}", f"parallel.expert={ep}", f"parallel.data={dp}",
                 f"trainer.micro_batch_tokens={tokens}", f"model.recompute={recompute}"])
    report = capsys.readouterr().out
    assert code == (0 if fits else 1), report
    assert f"published {name} shape" in report and f"TP {tp} x PP {pp} x DP {dp}" in report
    assert (f"(EP {ep})" in report) is (ep > 1 or "A" in name.split("-")[-1])


def test_plan_of_a_colocated_qwen3_moe_node_counts_experts_graphs_handoff_window_and_recorded_routing(capsys):
    """One node of 8 × 141 GB, colocated servers of TP 2: the servers serve all 30.5B parameters (experts included),
    their CUDA graphs are released with the rest, the handoff counts the IPC window's buckets, and routing replay's
    recorded routing is counted in host memory."""
    from dapo_megatron.cli import main

    code = main(["plan", str(REPO / "examples" / "dapo_qwen2.5_7b_1node.yaml"),
                 "model.hf_path=/models/Qwen3-30B-A3B-Instruct", "parallel.tensor=2", "parallel.expert=4",
                 "parallel.data=4", "trainer.micro_batch_tokens=4096", "model.recompute=full",
                 "algorithm.moe_routing_replay=replay_old", "rollout.sglang.num_servers=4",
                 "rollout.sglang.tp_per_server=2", "--gpu-memory-gb", "141"])
    report = capsys.readouterr().out
    assert code == 0, report
    assert "SGLang servers on the trainer's GPUs (rollout.placement: colocated): TP 2" in report
    assert "CUDA graphs released with the rest" in report
    handoff = next(line for line in report.splitlines() if " handoff " in line)
    server_gb = float(handoff.split()[3].removesuffix("GB"))
    assert server_gb == pytest.approx(2 + 30.53e9 * 2 / 2 / 1e9, abs=0.2)  # context + all weights / TP, experts too
    assert "routing replay (replay_old) on the GPU: " in report and "routing replay (replay_old: each rank's share" \
        in report


R3_NODE = ["model.hf_path=/models/Qwen3-30B-A3B-Instruct", "parallel.tensor=2", "parallel.pipeline=1",
           "parallel.expert=4", "parallel.data=4", "trainer.micro_batch_tokens=4096", "model.recompute=full",
           "algorithm.moe_routing_replay=replay_rollout",
           "rollout.sglang.extra_server_args=[--enable-return-routed-experts]"]


def test_plan_of_r3_on_the_docs_qwen3_30b_node_counts_routing_per_node_and_on_the_gpu(capsys):
    """Issue 40, items 2 and 3, at the docs' Qwen3-30B-A3B one-node layout (TP 2 x EP 4, DP 4, full recomputation,
    the paper's batch and lengths): each rank keeps only its share of the step's routing (DP share, its half of each
    row under sequence parallelism) and rank 0 the engine's routing it collected, summed per node against the host
    budget; on the GPU, the int64 targets of the micro-batches in flight, in the stage's total."""
    from dapo_megatron.cli import main
    from dapo_megatron.config import load_config
    from dapo_megatron.policy.memory.gpu import estimate_memory
    from dapo_megatron.policy.model_spec import model_spec_from_hf

    example = REPO / "examples" / "dapo_qwen2.5_32b.yaml"
    code = main(["plan", str(example), *R3_NODE])
    report = capsys.readouterr().out
    assert code == 0, report
    c = load_config(example, R3_NODE)
    length = c.data.max_prompt_length + c.rollout.max_response_length
    step_share = -(-c.trainer.train_batch_size * c.rollout.n_samples * length // (4 * 2)) * 48 * 8 * 2
    pass_share = -(-c.trainer.mini_batch_size * c.rollout.n_samples * length // (4 * 2)) * 48 * 8 * 2
    share = step_share + pass_share
    rank0 = (c.trainer.train_batch_size + c.algorithm.gen_batch_size) * c.rollout.n_samples * (length - 1) * 48 * 8 * 2
    assert (f"host memory per node: {(8 * share + rank0) / 1e9:.1f} GB on rank 0's node (8 ranks x "
            f"{share / 1e9:.2f} GB of routing replay" in report)
    assert f"rank 0's {rank0 / 1e9:.2f} GB of the engine's routing" in report
    assert "generation round, every layer)): fits in 1000 GB (parallel.host_memory_gb)" in report  # one node
    # every rank's share together is the step's routing once (it went whole to each of the 8 ranks: 8 x 141.7 GB)
    assert 8 * step_share == pytest.approx(c.trainer.train_batch_size * c.rollout.n_samples * length * 48 * 8 * 2)
    # the GPU: 4096 / 2 tokens x 48 layers x top-8, int64, in the stage total
    assert "on the GPU: 6.3 MB of int64 targets on stage 0, in its total" in report
    spec = model_spec_from_hf(published_hf_config("Qwen3-30B-A3B"))
    settings = dict(tensor_parallel=2, pipeline_parallel=1, data_parallel=4, expert_parallel=4,
                    micro_batch_tokens=4096, recompute="full")
    (replayed,), (plain,) = (estimate_memory(spec, **settings, routing_replay=r) for r in (True, False))
    assert replayed.total_bytes - plain.total_bytes == 4096 // 2 * 48 * 8 * 8
    # a node with less host memory: `plan` says so and exits 1
    assert main(["plan", str(example), *R3_NODE, "--host-memory-gb", "512"]) == 1
    assert "does NOT fit in 512 GB (parallel.host_memory_gb)" in capsys.readouterr().out


def test_the_input_checks_refuse_a_node_whose_host_memory_the_step_exceeds():
    """The same figure before a launch, against parallel.host_memory_gb (unset: the node's memory)."""
    from dapo_megatron.backend_registry import select_backend
    from dapo_megatron.config import ConfigError, load_config
    from dapo_megatron.run.input_checks import check_host_memory

    spec = model_spec_from_hf(published_hf_config("Qwen3-30B-A3B"))
    example = REPO / "examples" / "dapo_qwen2.5_32b.yaml"
    te = select_backend("auto", cuda_available=True, transformer_engine=True)
    with pytest.raises(ConfigError, match=r"parallel.host_memory_gb: a step of this run may need 717.5 GB of host "
                                          r"memory on rank 0's node \(8 ranks; .* but parallel.host_memory_gb has "
                                          r"512.0 GB"):
        check_host_memory(load_config(example, R3_NODE + ["parallel.host_memory_gb=512"]), spec, world_size=8,
                          backend=te, ranks_on_node=8)
    check_host_memory(load_config(example, R3_NODE + ["parallel.host_memory_gb=1000"]), spec, world_size=8,
                      backend=te, ranks_on_node=8)  # control
