"""The memory model of a GPU the trainer shares with a colocated SGLang server (rollout/gpu_sharing.py): SGLang's
own sizing rules reproduced by hand for known GPUs, the static share taken from the memory free at launch, the
turns' sums, and what the optimizer offload changes."""

from __future__ import annotations

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.rollout.gpu_sharing import (
    GB,
    MIB,
    handoff_buckets_on_gpu,
    SERVER_CONTEXT_BYTES,
    kv_bytes_per_token,
    model_parameters,
    sglang_cuda_graph_bytes,
    sglang_runtime_reserve_bytes,
    shared_gpus,
    sharing_report,
)
from dapo_megatron.policy.memory.gpu import FIXED_MARGIN_BYTES, plan_stages
from dapo_megatron.policy.model_spec import model_spec_from_hf
from dapo_megatron.policy.shapes import published_hf_config


def spec(name: str):
    return model_spec_from_hf(published_hf_config(name))


@pytest.mark.parametrize("gpu_gb,tp,mib", [
    (80, 1, 512 + 1.5 * 8192 + 1024 / 8 + 2 * 256),  # an H100: 74.5 GiB, chunked prefill 8192, graphs to 256
    (80, 4, 512 + 1.5 * 8192 + 1024 / 2 + 2 * 512),  # TP >= 4: graphs to 512
    (141, 1, 512 + 1.5 * 8192 + 1024 / 8 + 2 * 256),  # an H200: 131 GiB, the same row
    (64, 1, 512 + 1.5 * 4096 + 1024 / 8 + 2 * 32),  # 59.6 GiB: the 35-60 GiB row
    (24, 1, 512 + 1.5 * 4096 + 1024 / 8 + 2 * 48),  # 22.4 GiB: chunked prefill 4096, graphs to 48
    (16, 1, 512 + 1.5 * 2048 + 1024 / 8 + 2 * 8),  # below 20 GiB
])
def test_sglang_runtime_reserve_follows_its_own_rule(gpu_gb, tp, mib):
    assert sglang_runtime_reserve_bytes(gpu_gb * GB, tp) == int(mib * MIB)


@pytest.mark.parametrize("name,published_billions", [("Qwen2.5-0.5B", 0.49), ("Qwen2.5-1.5B", 1.54),
                                                     ("Qwen2.5-7B", 7.61), ("Qwen2.5-14B", 14.7)])
def test_served_parameters_match_the_published_counts(name, published_billions):
    assert model_parameters(spec(name)) / 1e9 == pytest.approx(published_billions, rel=0.01)


def test_kv_cache_per_token_splits_kv_heads_over_tp():
    qwen7b = spec("Qwen2.5-7B")  # 28 layers, 4 KV heads of 128
    assert kv_bytes_per_token(qwen7b, 1, 2) == 2 * 28 * 4 * 128 * 2
    assert kv_bytes_per_token(qwen7b, 2, 2) == 2 * 28 * 2 * 128 * 2
    assert kv_bytes_per_token(qwen7b, 8, 2) == 2 * 28 * 1 * 128 * 2  # more ranks than KV heads: replicated


COLOCATED_1GPU = ["model.source=hf", "model.hf_path=/nowhere/Qwen2.5-Math-1.5B", "data.source=synthetic",
                  "rollout.engine=sglang", "rollout.placement=colocated", "rollout.sglang.transport=tensor",
                  "rollout.sglang.mem_fraction_static=0.6", "trainer.micro_batch_tokens=8192"]


def _shared(overrides: list[str]):
    config = load_config(None, COLOCATED_1GPU + overrides)
    model = spec("Qwen2.5-Math-1.5B")
    stages, _ = plan_stages(config, model, data_parallel=1)
    return config, model, stages, shared_gpus(config, model, stages, data_parallel=1, gpu_memory_gb=80)


def test_the_server_takes_its_fraction_of_what_is_free_when_it_starts():
    config, model, (stage,), (gpu,) = _shared(["rollout.offload_optimizer=true"])
    trainer_generating = stage.params_bytes + FIXED_MARGIN_BYTES  # gradient buffers freed, optimizer state on host
    static = int(0.6 * (80 * GB - SERVER_CONTEXT_BYTES - trainer_generating))
    weights = model_parameters(model) * 2
    assert gpu.generation == (trainer_generating, SERVER_CONTEXT_BYTES + static + sglang_runtime_reserve_bytes(
        80 * GB, 1))
    assert gpu.kv_cache_bytes == static - weights
    assert gpu.kv_cache_tokens == (static - weights) // (2 * 28 * 2 * 128 * 2)
    assert gpu.training == (stage.total_bytes, SERVER_CONTEXT_BYTES)  # the server released all but its context
    bucket = max(512 * MIB, model.vocab_size * model.hidden_size * 2)  # a bucket, or the embedding alone
    # tensor transport: the IPC window's 2 buckets, the one being sent and the next one gathered
    assert handoff_buckets_on_gpu("tensor") == 4 and handoff_buckets_on_gpu("disk") == 2
    trainer_resident = trainer_generating + stage.grads_bytes  # the gradient buffers are back for the update
    assert gpu.handoff == (trainer_resident + stage.optimizer_bytes + 4 * bucket, SERVER_CONTEXT_BYTES + weights)
    assert gpu.fits(80 * GB)


def test_cuda_graphs_the_server_keeps_are_counted_in_the_training_and_handoff_turns(monkeypatch):
    config, model, stages, (released,) = _shared([])
    (kept,) = shared_gpus(config, model, stages, data_parallel=1, gpu_memory_gb=80, cuda_graphs_released=False)
    graphs = sglang_cuda_graph_bytes(80 * GB, 1)
    assert graphs == 2 * 256 * MIB  # SGLang 0.5.23's decode graph batch on an 80 GB GPU at TP 1
    assert kept.training[1] - released.training[1] == graphs and kept.handoff[1] - released.handoff[1] == graphs
    assert kept.generation == released.generation  # the graphs are in the runtime reserve while generating either way
    monkeypatch.setenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "0")  # plan reads what the launched servers will get
    lines, _ = sharing_report(config, model, stages, data_parallel=1, gpu_memory_gb=80)
    assert "CUDA graphs resident in every turn" in lines[0]
    monkeypatch.delenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH")
    lines, _ = sharing_report(config, model, stages, data_parallel=1, gpu_memory_gb=80)
    assert "CUDA graphs released with the rest" in lines[0]


def test_a_moe_server_serves_its_experts_and_their_adam_moments_divide_by_dp_over_ep():
    from dapo_megatron.policy.memory.gpu import moe_layer_parameters

    moe = spec("Qwen3-30B-A3B")
    experts = moe.num_layers * moe_layer_parameters(moe, 1, 1)
    assert experts > 28e9  # Qwen3-30B-A3B: 128 experts x 48 layers of 3 x 768 x 2048
    assert model_parameters(moe) == pytest.approx(30.5e9, rel=0.01)  # the published 30.5B, experts included
    config = load_config(None, ["model.source=hf", "model.hf_path=/nowhere/Qwen3-30B-A3B", "data.source=synthetic",
                                "rollout.engine=sglang", "rollout.placement=colocated",
                                "rollout.sglang.transport=tensor", "rollout.sglang.mem_fraction_static=0.5",
                                "rollout.sglang.tp_per_server=2", "parallel.tensor=2", "parallel.expert=4",
                                "parallel.use_distributed_optimizer=true", "trainer.micro_batch_tokens=4096"])
    stages, _ = plan_stages(config, moe, data_parallel=4)
    (stage,) = stages
    assert 0 < stage.expert_parameters < stage.parameters
    (gpu,) = shared_gpus(config, moe, stages, data_parallel=4, gpu_memory_gb=141)
    dense_moments = (stage.parameters - stage.expert_parameters) * 8 / 4
    expert_moments = stage.expert_parameters * 8 / (4 // 4)  # the experts' DP group: DP / EP = 1 rank
    main_params = stage.optimizer_bytes - int(dense_moments + expert_moments)
    # a generation turn without offload holds the whole optimizer state; the launch held only the main parameters;
    # both without the gradient buffers
    resident = stage.params_bytes + FIXED_MARGIN_BYTES
    free_at_launch = 141 * GB - SERVER_CONTEXT_BYTES - resident - main_params
    assert gpu.generation[1] == SERVER_CONTEXT_BYTES + int(0.5 * free_at_launch) + sglang_runtime_reserve_bytes(
        141 * GB, 2)


def test_without_the_offload_adams_moments_eat_the_servers_runtime_share():
    _, _, (stage,), (offloaded,) = _shared(["rollout.offload_optimizer=true"])
    _, _, _, (kept,) = _shared(["rollout.offload_optimizer=false"])
    moments = stage.parameters * 8
    main_params = stage.optimizer_bytes - moments
    assert kept.generation[0] - offloaded.generation[0] == stage.optimizer_bytes
    # The server started next to the fp32 main parameters (the moments came later): a smaller static share.
    assert offloaded.generation[1] - kept.generation[1] == pytest.approx(0.6 * main_params, abs=1)
    assert not kept.fits(80 * GB) and offloaded.fits(80 * GB)


def test_a_fraction_too_small_for_the_weights_leaves_no_kv_cache_and_is_reported():
    config, model, stages, (gpu,) = _shared(["rollout.sglang.mem_fraction_static=0.04"])
    assert gpu.kv_cache_bytes <= 0 and not gpu.fits(80 * GB)
    lines, fits = sharing_report(config, model, stages, data_parallel=1, gpu_memory_gb=80)
    assert not fits and any("SGLang refuses to start" in line for line in lines)


def test_separate_placement_and_the_embedded_engine_share_nothing():
    separate = load_config(None, ["model.source=hf", "model.hf_path=/nowhere/Qwen2.5-7B", "data.source=synthetic"])
    model = spec("Qwen2.5-7B")
    stages, _ = plan_stages(separate, model, data_parallel=1)
    lines, fits = sharing_report(separate, model, stages, data_parallel=1, gpu_memory_gb=80)
    assert fits and lines == ["SGLang servers: on GPUs of their own (rollout.placement: separate); the trainer has "
                              "its GPUs to itself"]
    embedded = load_config(None, ["model.source=tiny", "data.source=synthetic", "rollout.engine=embedded"])
    assert sharing_report(embedded, model, stages, data_parallel=1, gpu_memory_gb=80) == ([], True)
