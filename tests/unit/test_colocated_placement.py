"""rollout.placement: colocated, decided on CPU: the config it needs, where the servers go and how they start
(``--enable-memory-saver``, read from the command line the real launcher logged), the servers' memory turns as a
state machine that never resumes what a server holds (SGLang 0.5.23 dies of that), and the order of the trainer's
turns. The same turns against the real CPU SGLang server: tests/integration/test_sglang_colocated.py."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from sglang_fixtures import exiting_python, launched_argv

from dapo_megatron.config import ConfigError, SGLangConfig, load_config
from dapo_megatron.rollout.engine import RolloutError
from dapo_megatron.rollout.placement import (
    ALL_MEMORY,
    CUDA_GRAPH,
    KV_CACHE,
    WEIGHTS,
    ServerMemory,
    ServerMemoryError,
    check_attached_server,
    colocated_gpu_ranges,
    rank_shares_a_server_gpu,
    require_one_stage_per_server,
    uses_memory_saver,
)
from dapo_megatron.rollout.sglang.client import SGLangServerError
from dapo_megatron.rollout.sglang.pool import ServerPool
from dapo_megatron.rollout.sglang.server import MEMORY_SAVER_FLAG, SGLangServerProcess
from dapo_megatron.trainer.colocation import Colocation

REPO = Path(__file__).resolve().parents[2]
COLOCATED = ["model.source=tiny", "data.source=synthetic", "rollout.engine=sglang", "rollout.placement=colocated",
             "rollout.sglang.transport=tensor", "rollout.sglang.mem_fraction_static=0.5"]


# ---- configuration ---------------------------------------------------------------------------------------------------
def test_a_colocated_config_loads_and_separate_is_the_default():
    config = load_config(None, COLOCATED + ["rollout.offload_optimizer=true"])
    assert config.rollout.placement == "colocated" and config.rollout.offload_optimizer
    assert load_config(None, ["model.source=tiny", "data.source=synthetic"]).rollout.placement == "separate"


@pytest.mark.parametrize("override,message", [
    ("rollout.engine=embedded", r"rollout\.placement: colocated places SGLang servers.*rollout\.engine: sglang"),
    ("rollout.mode=async", r"rollout\.placement: .*needs rollout\.mode: sync"),
    ("rollout.sglang.transport=distributed", r"rollout\.sglang\.transport: distributed cannot reach colocated "
                                             r"servers: NCCL refuses"),
    ("rollout.sglang.mem_fraction_static=null", r"rollout\.sglang\.mem_fraction_static: must be set under "
                                                r"rollout\.placement: colocated"),
])
def test_what_colocated_placement_cannot_work_with_is_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, COLOCATED + [override])


def test_offloading_the_optimizer_needs_colocated_servers():
    with pytest.raises(ConfigError, match=r"rollout\.offload_optimizer: .*needs rollout\.placement: colocated"):
        load_config(None, ["model.source=tiny", "data.source=synthetic", "rollout.offload_optimizer=true"])


# ---- where the servers go, how they start ----------------------------------------------------------------------------
def test_colocated_servers_take_the_trainers_gpus_from_gpu_0():
    config = SGLangConfig(num_servers=4, tp_per_server=2, transport="tensor")
    assert colocated_gpu_ranges(config, trainer_local_ranks=8, visible_gpus=8) == [range(0, 2), range(2, 4),
                                                                                    range(4, 6), range(6, 8)]
    one_gpu = SGLangConfig(num_servers=1, tp_per_server=1, transport="tensor")
    assert colocated_gpu_ranges(one_gpu, trainer_local_ranks=1, visible_gpus=1) == [range(0, 1)]
    shifted = SGLangConfig(num_servers=1, tp_per_server=2, base_gpu_id=2, transport="disk")
    assert colocated_gpu_ranges(shifted, trainer_local_ranks=4, visible_gpus=8) == [range(2, 4)]


def test_a_colocated_server_beyond_the_trainers_gpus_is_refused():
    config = SGLangConfig(num_servers=3, tp_per_server=2, transport="tensor")
    with pytest.raises(ConfigError, match=r"colocated, but rollout\.sglang\.num_servers \(3\) x tp_per_server \(2\) "
                                          r"from GPU 0 reach GPU 5, and the trainer's 4 rank\(s\) on this node use "
                                          r"GPUs 0\.\.3"):
        colocated_gpu_ranges(config, trainer_local_ranks=4, visible_gpus=8)


def test_a_colocated_server_spanning_two_pipeline_stages_is_refused():
    # 8 GPUs, TP 2 x DP 2 x PP 2: GPUs 0-3 hold stage 0, GPUs 4-7 stage 1
    wide = SGLangConfig(num_servers=2, tp_per_server=4, base_gpu_id=2, transport="tensor")
    with pytest.raises(ConfigError, match=r"SGLang server 0 \(rollout\.sglang\.tp_per_server=4\) spans GPUs 2\.\.5, "
                                          r"which hold pipeline stages 0\.\.1"):
        require_one_stage_per_server(wide, [range(2, 6)], ranks_per_stage=4, pipeline=2)
    # controls: the same servers from GPU 0 lie within a stage each; and without pipeline stages nothing differs
    aligned = SGLangConfig(num_servers=2, tp_per_server=4, transport="tensor")
    ranges = colocated_gpu_ranges(aligned, trainer_local_ranks=8, visible_gpus=8)
    require_one_stage_per_server(aligned, ranges, ranks_per_stage=4, pipeline=2)
    require_one_stage_per_server(wide, [range(2, 6)], ranks_per_stage=8, pipeline=1)


def test_the_memory_saver_is_for_colocated_servers_on_gpus():
    assert uses_memory_saver("colocated", "cuda")
    assert not uses_memory_saver("separate", "cuda") and not uses_memory_saver("colocated", "cpu")


def test_an_attached_gpu_server_without_the_memory_saver_is_refused():
    with pytest.raises(SGLangServerError, match=r"http://node3:30000 was started without --enable-memory-saver"):
        check_attached_server("http://node3:30000", {"device": "cuda", "enable_memory_saver": False})
    check_attached_server("http://node3:30000", {"device": "cuda", "enable_memory_saver": True})
    check_attached_server("http://127.0.0.1:30000", {"device": "cpu", "enable_memory_saver": False})


@pytest.mark.parametrize("placement,first_gpus,saver", [("colocated", ["0", "2"], True),
                                                         ("separate", ["4", "6"], False)])
def test_the_pool_launches_colocated_servers_on_the_trainer_gpus_with_the_memory_saver(
        tmp_path, monkeypatch, placement, first_gpus, saver):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # a GPU node, seen from a CPU machine
    config = SGLangConfig(python=exiting_python(tmp_path), num_servers=2, tp_per_server=2, base_port=0,
                          transport="tensor", mem_fraction_static=0.5, launch_timeout_s=60)
    pool = ServerPool(config, model_path=str(tmp_path), run_dir=tmp_path / "run", device="cuda", placement=placement)
    with pytest.raises(RolloutError, match="exited with code 1"):
        pool.start()
    pool.stop()
    for index, first_gpu in enumerate(first_gpus):
        argv = launched_argv(tmp_path / "run" / f"server{index}.log")
        assert argv[argv.index("--base-gpu-id") + 1] == first_gpu
        assert (MEMORY_SAVER_FLAG in argv) == saver


def test_the_pool_launches_on_the_gpus_the_trainer_located_once(tmp_path, monkeypatch):
    """The trainer's colocation places the servers on every rank (Colocation.locate_servers); rank 0's pool launches
    them there instead of laying them out a second time."""
    from dapo_megatron.rollout.sglang import pool as pool_module

    def laid_out_again(*args, **kwargs):
        raise AssertionError("the pool laid the colocated servers out again")

    monkeypatch.setattr(pool_module, "colocated_gpu_ranges", laid_out_again)
    config = SGLangConfig(python=exiting_python(tmp_path), num_servers=2, tp_per_server=2, base_port=0,
                          transport="tensor", mem_fraction_static=0.5, launch_timeout_s=60)
    pool = ServerPool(config, model_path=str(tmp_path), run_dir=tmp_path / "run", device="cuda",
                      placement="colocated", server_gpus=[range(4, 6), range(6, 8)])
    with pytest.raises(RolloutError, match="exited with code 1"):
        pool.start()
    pool.stop()
    starts = [launched_argv(tmp_path / "run" / f"server{i}.log") for i in range(2)]
    assert [argv[argv.index("--base-gpu-id") + 1] for argv in starts] == ["4", "6"]


@pytest.mark.parametrize("change, world, on_gpu, copies", [
    ([], 8, True, True),  # the 7B one-node examples: 8 trainer ranks, colocated servers, tensor transport
    (["rollout.sglang.transport=disk"], 8, True, False),
    (["parallel.pipeline=2"], 8, True, False),  # a rank holds its stage's layers only
    (["rollout.sglang.urls=[http://127.0.0.1:1]"], 8, True, False),  # attached: their GPUs unknown
    ([], 16, True, False),  # two nodes: the servers are on the first
    ([], 8, False, False),  # CPU: no CUDA IPC
])
def test_the_handoff_copies_buckets_to_every_gpu_only_where_the_servers_can_open_them(change, world, on_gpu,
                                                                                        copies):
    from dapo_megatron.trainer.colocation import copies_on_every_gpu

    config = load_config(None, COLOCATED + change)
    assert copies_on_every_gpu(config, on_gpu=on_gpu, world_size=world, ranks_on_node=8) is copies


def test_a_cpu_server_starts_without_the_memory_saver(tmp_path):
    server = SGLangServerProcess(SGLangConfig(), model_path=tmp_path, index=0, run_dir=tmp_path, weight_version="0",
                                 device="cpu", memory_saver=uses_memory_saver("colocated", "cpu"))
    assert MEMORY_SAVER_FLAG not in server.command(tmp_path / "c.yaml")


# ---- the servers' memory turns ---------------------------------------------------------------------------------------
def test_one_step_of_turns_releases_and_resumes_in_the_order_verl_and_slime_use():
    memory = ServerMemory()
    assert memory.can_generate and memory.for_generation() == ()  # a fresh server holds everything
    moves = []
    for turn, release in ((ServerMemory.after_generation, True), (ServerMemory.for_training, True),
                          (ServerMemory.for_weight_update, False), (ServerMemory.for_generation, False)):
        tags = turn(memory)
        moves.append(("release" if release else "resume", tags))
        memory = memory.released(tags) if release else memory.resumed(tags)
    assert moves == [("release", (KV_CACHE, CUDA_GRAPH)), ("release", (WEIGHTS,)), ("resume", (WEIGHTS,)),
                     ("resume", (KV_CACHE, CUDA_GRAPH))]
    assert memory == ServerMemory() and memory.can_generate


def test_generating_with_released_weights_is_refused_before_the_server_sees_it():
    released = ServerMemory().released(ALL_MEMORY)
    assert not released.can_generate
    with pytest.raises(ServerMemoryError, match="weights were released .* hand off the weights before generating"):
        released.for_generation()
    # Validation between two handoffs: the KV cache goes and comes back, the weights stay.
    kv_only = ServerMemory().released((KV_CACHE, CUDA_GRAPH))
    assert kv_only.for_generation() == (KV_CACHE, CUDA_GRAPH) and kv_only.for_weight_update() == ()


def test_no_order_of_turns_ever_resumes_what_a_server_holds_or_releases_it_twice():
    """Every sequence of turns (random, and all of length 4): each resume names only released tags and each release
    only held ones — a wrong resume kills an SGLang 0.5.23 server (tests/integration/test_sglang_colocated.py shows
    it)."""
    turns = [(ServerMemory.after_generation, True), (ServerMemory.for_training, True),
             (ServerMemory.for_weight_update, False), (ServerMemory.for_generation, False)]
    sequences = list(itertools.product(turns, repeat=4))
    generator = random.Random(0)
    sequences += [[generator.choice(turns) for _ in range(12)] for _ in range(200)]
    refused = 0
    for sequence in sequences:
        memory = ServerMemory()
        for turn, release in sequence:
            try:
                tags = turn(memory)
            except ServerMemoryError:
                refused += 1
                continue
            if release:
                assert not set(tags) & memory.released_tags
                memory = memory.released(tags)
            else:
                assert set(tags) <= memory.released_tags
                memory = memory.resumed(tags)
    assert refused > 0  # the sequences include generation after a release of the weights: the refusal ran


# ---- the trainer's turns ---------------------------------------------------------------------------------------------
class _Recorder:
    """Stands in for the optimizer and the engine in the one thing CPU cannot show: the ORDER of the trainer's and
    the servers' moves (on CPU the optimizer does not move and the servers free nothing). The moves themselves run
    for real on a GPU (bench/gpu_check.py) and against the CPU server (tests/integration/test_sglang_colocated.py)."""

    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def __getattr__(self, method):
        return lambda: self.log.append(f"{self.name}.{method}")


def test_the_trainer_moves_its_optimizer_out_before_the_servers_take_memory_and_back_after_they_gave_it():
    log: list[str] = []
    engine = _Recorder(log, "engine")
    colocation = Colocation(load_config(None, COLOCATED + ["rollout.offload_optimizer=true"]), _Recorder(log, "opt"),
                            lambda: engine, device_type="cuda", model=_Recorder(log, "ddp"))
    with colocation.generating():
        log.append("generate")
    colocation.before_policy_update()
    log.append("update")
    assert log == ["ddp.offload_grad_buffers", "opt.offload_to_cpu", "engine.before_generation", "generate",
                   "engine.after_generation", "opt.restore_from_cpu", "ddp.restore_grad_buffers",
                   "engine.before_policy_update", "update"]


def test_a_rank_whose_gpu_hosts_no_server_moves_nothing():
    # 8 GPUs a node, two servers of TP 2 on GPUs 0-3 of rank 0's node
    ranges = [range(0, 2), range(2, 4)]
    assert rank_shares_a_server_gpu(ranges, global_rank=3, local_rank=3, visible_gpus=8)
    assert not rank_shares_a_server_gpu(ranges, global_rank=5, local_rank=5, visible_gpus=8)  # GPU 5: no server
    assert not rank_shares_a_server_gpu(ranges, global_rank=11, local_rank=3, visible_gpus=8)  # another node
    assert rank_shares_a_server_gpu(ranges, global_rank=0, local_rank=0, visible_gpus=1)  # SLURM: one GPU bound
    log: list[str] = []
    elsewhere = Colocation(load_config(None, COLOCATED + ["rollout.offload_optimizer=true"]), _Recorder(log, "opt"),
                           lambda: _Recorder(log, "engine"), device_type="cuda", model=_Recorder(log, "ddp"))
    elsewhere.shares_a_server_gpu = False  # what locate_servers() sets on such a rank
    with elsewhere.generating():
        pass
    assert log == ["engine.before_generation", "engine.after_generation"]  # the servers' turns still run


def test_separate_placement_and_cpu_move_nothing():
    log: list[str] = []
    separate = Colocation(load_config(None, ["model.source=tiny", "data.source=synthetic"]), _Recorder(log, "opt"),
                          lambda: _Recorder(log, "engine"), device_type="cuda")
    with separate.generating():
        pass
    separate.before_policy_update()
    separate.before_handoff(base_served=True)
    assert log == []
    on_cpu = Colocation(load_config(None, COLOCATED + ["rollout.offload_optimizer=true"]), _Recorder(log, "opt"),
                        lambda: None, device_type="cpu")  # no engine yet: the turn that launches the servers
    with on_cpu.generating():
        pass
    assert log == []  # the optimizer state is in host memory already
