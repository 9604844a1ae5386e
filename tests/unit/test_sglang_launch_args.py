"""What launched SGLang servers are given on a GPU node, decided on CPU: their GPUs next to the trainer's
(``--base-gpu-id``, ``--mem-fraction-static``, the refused "duplicate GPU" layout), the served ``--dtype`` from the
trainer's precision, and ``NCCL_CUMEM_ENABLE=0`` on both ends when NCCL carries the weights.

The launch tests run the real pool/engine code up to the process start with a stand-in interpreter that exits at once
(no SGLang, no GPU here), and read the command line the launcher logged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from sglang_fixtures import exiting_python, launched_argv

from dapo_megatron.backend_registry import select_backend
from dapo_megatron.config import ConfigError, SGLangConfig, load_config
from dapo_megatron.launch_env import local_world_size
from dapo_megatron.platform import FLIGHT_RECORDER_DIR, FLIGHT_RECORDER_FILE_ENV, flight_recorder_env
from dapo_megatron.rollout.engine import RolloutError
from dapo_megatron.rollout.sglang.client import SGLangServerError
from dapo_megatron.rollout.sglang.gpus import nccl_carries_weights, server_gpu_ranges, trainer_nccl_env
from dapo_megatron.rollout.sglang.pool import ServerPool
from dapo_megatron.rollout.sglang.server import (
    MEMORY_SAVER_CUDA_GRAPH_ENV,
    SGLangServerProcess,
    cuda_graphs_released,
    served_dtype,
)

REPO = Path(__file__).resolve().parents[2]


# ---- GPUs --------------------------------------------------------------------------------------------------------
def test_servers_take_the_gpus_after_the_trainer_ranks_by_default():
    config = SGLangConfig(num_servers=2, tp_per_server=2, transport="distributed")
    assert server_gpu_ranges(config, trainer_local_ranks=4, visible_gpus=8) == [range(4, 6), range(6, 8)]
    # The launch path before this fix put server i at GPU i*T: server 0 on GPU 0, trainer rank 0's GPU.
    assert 0 not in server_gpu_ranges(config, trainer_local_ranks=1, visible_gpus=8)[0]
    explicit = SGLangConfig(num_servers=2, tp_per_server=2, base_gpu_id=2, transport="tensor")
    assert server_gpu_ranges(explicit, trainer_local_ranks=2, visible_gpus=8) == [range(2, 4), range(4, 6)]


def test_a_server_on_a_trainer_gpu_is_refused_with_the_distributed_transport():
    shared = SGLangConfig(num_servers=1, tp_per_server=2, base_gpu_id=2, transport="distributed")
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.base_gpu_id.*trainer GPU\(s\) \[2, 3\].*"
                                          r"rollout\.sglang\.transport=distributed.*Duplicate GPU"):
        server_gpu_ranges(shared, trainer_local_ranks=4, visible_gpus=8)
    # Control: the same layout is allowed where no NCCL group joins the two (colocated tensor/disk transports).
    for transport in ("tensor", "disk"):
        colocated = SGLangConfig(num_servers=1, tp_per_server=2, base_gpu_id=2, transport=transport)
        assert server_gpu_ranges(colocated, trainer_local_ranks=4, visible_gpus=8) == [range(2, 4)]
    # One GPU per task (clusters that bind them): trainer rank r drives GPU r % 1 = 0.
    with pytest.raises(ConfigError, match=r"trainer GPU\(s\) \[0\]"):
        server_gpu_ranges(SGLangConfig(base_gpu_id=0, transport="distributed"), trainer_local_ranks=4,
                          visible_gpus=1)


def test_a_layout_beyond_the_node_names_the_keys():
    config = SGLangConfig(num_servers=3, tp_per_server=2)
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.base_gpu_id \(unset: after the trainer's ranks\), "
                                          r"num_servers \(3\) and tp_per_server \(2\) put the servers on GPUs 4\.\.9, "
                                          r"but this node shows 8 GPU"):
        server_gpu_ranges(config, trainer_local_ranks=4, visible_gpus=8)


def test_trainer_ranks_per_node_come_from_the_launcher():
    assert local_world_size({"LOCAL_WORLD_SIZE": "4", "SLURM_NTASKS_PER_NODE": "8"}) == 4  # torchrun
    assert local_world_size({"SLURM_NTASKS_PER_NODE": "8"}) == 8
    assert local_world_size({"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}) == 3
    assert local_world_size({"SLURM_TASKS_PER_NODE": "4(x2),3"}) == 4
    assert local_world_size({}) == 1
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE: '4\(x2' is not a SLURM task count list"):
        local_world_size({"SLURM_TASKS_PER_NODE": "4(x2"})


def test_gpu_and_memory_arguments_of_a_cuda_server(tmp_path):
    config = SGLangConfig(tp_per_server=2, mem_fraction_static=0.7)
    server = SGLangServerProcess(config, model_path=tmp_path, index=1, run_dir=tmp_path, weight_version="0",
                                 device="cuda", gpus=range(6, 8))
    command = server.command(tmp_path / "c.yaml")
    assert command[command.index("--base-gpu-id") + 1] == "6"
    assert command[command.index("--mem-fraction-static") + 1] == "0.7"
    unset = SGLangServerProcess(SGLangConfig(tp_per_server=2), model_path=tmp_path, index=1, run_dir=tmp_path,
                                weight_version="0", device="cuda", gpus=range(6, 8))
    assert "--mem-fraction-static" not in unset.command(tmp_path / "c.yaml")  # SGLang's own default
    with pytest.raises(ValueError, match="needs its 2 GPU"):
        SGLangServerProcess(config, model_path=tmp_path, index=0, run_dir=tmp_path, weight_version="0",
                            device="cuda", gpus=None)


def test_config_checks_the_gpu_keys():
    config = load_config(None, ["model.source=tiny", "data.source=synthetic", "rollout.sglang.base_gpu_id=4",
                                "rollout.sglang.mem_fraction_static=0.6"])
    assert config.rollout.sglang.base_gpu_id == 4 and config.rollout.sglang.mem_fraction_static == 0.6
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.mem_fraction_static: must be in \(0, 1\)"):
        load_config(None, ["model.source=tiny", "data.source=synthetic", "rollout.sglang.mem_fraction_static=1.5"])
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.base_gpu_id: must be >= 0"):
        load_config(None, ["model.source=tiny", "data.source=synthetic", "rollout.sglang.base_gpu_id=-1"])


def test_the_pool_launches_cuda_servers_after_the_trainer_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # a GPU node, seen from a CPU machine
    config = SGLangConfig(python=exiting_python(tmp_path), num_servers=2, tp_per_server=2, base_port=0,
                          transport="distributed", mem_fraction_static=0.8, launch_timeout_s=60)
    pool = ServerPool(config, model_path=str(tmp_path), run_dir=tmp_path / "run", device="cuda", dtype="bfloat16")
    with pytest.raises(RolloutError, match="exited with code 1"):
        pool.start()
    pool.stop()
    for index, first_gpu in ((0, "4"), (1, "6")):
        argv = launched_argv(tmp_path / "run" / f"server{index}.log")
        assert argv[argv.index("--base-gpu-id") + 1] == first_gpu
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.8"
        assert argv[argv.index("--dtype") + 1] == "bfloat16"
    # The refused layout stops before any process starts.
    refused = SGLangConfig(python=config.python, base_gpu_id=0, transport="distributed")
    with pytest.raises(ConfigError, match="Duplicate GPU"):
        ServerPool(refused, model_path=str(tmp_path), run_dir=tmp_path / "refused", device="cuda").start()
    assert not (tmp_path / "refused").exists()


# ---- served dtype ---------------------------------------------------------------------------------------------------
def test_served_dtype_follows_the_trainer_precision(tmp_path):
    assert [served_dtype(p) for p in ("bf16", "fp8", "fp32")] == ["bfloat16", "bfloat16", "float32"]
    server = SGLangServerProcess(SGLangConfig(), model_path=tmp_path, index=0, run_dir=tmp_path, weight_version="0",
                                 device="cpu", dtype="bfloat16")
    command = server.command(tmp_path / "c.yaml")
    assert command[command.index("--dtype") + 1] == "bfloat16"
    for args in (["--dtype", "float16"], ["--dtype=float16"]):
        server = SGLangServerProcess(SGLangConfig(extra_server_args=args), model_path=tmp_path, index=0,
                                     run_dir=tmp_path, weight_version="0", device="cpu", dtype="bfloat16")
        command = server.command(tmp_path / "c.yaml")
        assert "bfloat16" not in command and command[-len(args):] == args  # the user's choice, once


@pytest.mark.parametrize("precision,dtype", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_the_trainer_launches_servers_in_its_precision(tmp_path, precision, dtype):
    """The run config's model.precision reaches the server command through the engine factory."""
    from dapo_megatron.rollout.factory import build_rollout_engine

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    config = load_config(REPO / "examples" / "tiny_cpu_sglang.yaml",
                         [f"model.precision={precision}", f"rollout.sglang.python={exiting_python(tmp_path)}",
                          "rollout.sglang.base_port=0", "rollout.sglang.launch_timeout_s=60"])
    with pytest.raises(RolloutError, match="exited with code 1"):
        build_rollout_engine(config, model_dir, tmp_path / "run", select_backend())
    argv = launched_argv(tmp_path / "run" / "sglang" / "server0.log")
    assert argv[argv.index("--dtype") + 1] == dtype


# ---- NCCL_CUMEM_ENABLE ----------------------------------------------------------------------------------------------
def _run_config(engine: str, transport: str):
    return load_config(None, ["model.source=tiny", "data.source=synthetic", f"rollout.engine={engine}",
                              f"rollout.sglang.transport={transport}"])


def test_nccl_cumem_is_turned_off_in_the_trainer_only_when_nccl_carries_weights():
    assert trainer_nccl_env(_run_config("sglang", "distributed"), cuda_available=True) == {"NCCL_CUMEM_ENABLE": "0"}
    assert trainer_nccl_env(_run_config("sglang", "distributed"), cuda_available=False) == {}  # gloo on CPU
    assert trainer_nccl_env(_run_config("sglang", "tensor"), cuda_available=True) == {}
    assert trainer_nccl_env(_run_config("embedded", "distributed"), cuda_available=True) == {}
    assert nccl_carries_weights("distributed", "cuda") and not nccl_carries_weights("disk", "cuda")


def test_the_cli_sets_it_before_the_process_groups_exist(monkeypatch):
    from dapo_megatron.commands import process_layout

    seen = {}
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(process_layout, "init_distributed",
                        lambda *a, **k: seen.setdefault("env", os.environ.get("NCCL_CUMEM_ENABLE")))
    process_layout.init_process_layout(_run_config("sglang", "distributed"))
    assert seen["env"] == "0"
    monkeypatch.delenv("NCCL_CUMEM_ENABLE")
    seen.clear()
    process_layout.init_process_layout(_run_config("sglang", "disk"))  # control: nothing set without NCCL weights
    assert seen["env"] is None


def test_servers_get_it_in_their_launch_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")  # inherited from the user's shell: SGLang would keep it

    def environment(transport: str, device: str) -> dict[str, str]:
        return SGLangServerProcess(SGLangConfig(transport=transport), model_path=tmp_path, index=0, run_dir=tmp_path,
                                   weight_version="0", device=device,
                                   gpus=range(1, 2) if device == "cuda" else None).environment()

    assert environment("distributed", "cuda")["NCCL_CUMEM_ENABLE"] == "0"
    assert environment("tensor", "cuda")["NCCL_CUMEM_ENABLE"] == "1"  # control: left alone without NCCL weights
    assert environment("distributed", "cpu")["NCCL_CUMEM_ENABLE"] == "1"


def test_servers_write_nccl_flight_recorder_dumps_under_names_of_their_own(tmp_path, monkeypatch):
    """The trainer's flight recorder (platform.flight_recorder_env) is in the environment the servers inherit; their
    TP ranks number from 0 like the trainer's, so the same prefix would have them overwrite the trainer's dumps."""
    def environment(index: int) -> dict[str, str]:
        return SGLangServerProcess(SGLangConfig(transport="distributed"), model_path=tmp_path, index=index,
                                   run_dir=tmp_path, weight_version="0", device="cuda", gpus=range(0, 1)).environment()

    monkeypatch.delenv(FLIGHT_RECORDER_FILE_ENV, raising=False)
    assert FLIGHT_RECORDER_FILE_ENV not in environment(0)  # control: none set, none given
    trainer_prefix = flight_recorder_env(tmp_path / "run", "nccl", environ={})[FLIGHT_RECORDER_FILE_ENV]
    monkeypatch.setenv(FLIGHT_RECORDER_FILE_ENV, trainer_prefix)
    assert environment(1)[FLIGHT_RECORDER_FILE_ENV] == str(tmp_path / "run" / FLIGHT_RECORDER_DIR / "server1_rank_")


def test_memory_saver_servers_put_their_cuda_graphs_in_a_released_region(tmp_path, monkeypatch):
    monkeypatch.delenv(MEMORY_SAVER_CUDA_GRAPH_ENV, raising=False)

    def environment(memory_saver: bool) -> dict[str, str]:
        return SGLangServerProcess(SGLangConfig(transport="tensor"), model_path=tmp_path, index=0, run_dir=tmp_path,
                                   weight_version="0", device="cuda", gpus=range(0, 1),
                                   memory_saver=memory_saver).environment()

    assert environment(True)[MEMORY_SAVER_CUDA_GRAPH_ENV] == "1"
    assert MEMORY_SAVER_CUDA_GRAPH_ENV not in environment(False)  # control: a separate server keeps SGLang's default
    assert cuda_graphs_released(environment(True)) and cuda_graphs_released({})
    monkeypatch.setenv(MEMORY_SAVER_CUDA_GRAPH_ENV, "0")  # the user's own choice is kept, and plan counts the graphs
    assert environment(True)[MEMORY_SAVER_CUDA_GRAPH_ENV] == "0"
    assert not cuda_graphs_released(environment(True))


# --------------------------------------------------------------- requests in flight (issue 26, item 7)


def _server_info(*limits):
    """/server_info as SGLang 0.5.23 shapes it: one internal state per data-parallel rank."""
    return {"tp_size": 4, "internal_states": [{"effective_max_running_requests_per_dp": limit} for limit in limits]}


def test_samples_in_flight_fill_every_server_of_the_layout():
    from dapo_megatron.rollout.sglang.pool import in_flight_samples, server_capacity

    capacities = [server_capacity(_server_info(2048), f"http://s{i}") for i in range(16)]  # the 32B layout's 16
    assert in_flight_samples(capacities) == 16 * 2048  # every sequence every server runs, not 64 requests in all
    assert server_capacity(_server_info(1000, 1000), "http://dp2") == 2000  # data-parallel ranks add up
    with pytest.raises(SGLangServerError, match="effective_max_running_requests_per_dp.*max_in_flight_samples"):
        server_capacity({"tp_size": 1}, "http://other")
    assert SGLangConfig().max_in_flight_samples is None  # derived unless set
