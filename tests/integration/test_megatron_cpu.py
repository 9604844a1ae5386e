"""Foundation: megatron-core (GPTModel with the local spec — RMSNorm, SwiGLU, GQA, RoPE — Megatron DDP, the Megatron
optimizer, the pipeline schedules) trains on CPU over gloo at every parallel layout, and launch mistakes are clear
errors rather than hangs.

Each layout is one spawn of real processes running :class:`dapo_megatron.policy.actor.Actor` for a few steps; the
checks: the loss falls, gradient clipping is configured and engaged, DP replicas end with identical parameters.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from spawn_ranks import run_distributed

STEPS = 5

# (tensor_parallel, pipeline_parallel, data_parallel, distributed optimizer)
LAYOUTS = [
    pytest.param(2, 1, 2, True, id="tp2-pp1-dp2-distopt"),
    pytest.param(1, 2, 2, False, id="tp1-pp2-dp2"),
    # TP2 x PP2 trains in the actor's parity test (test_policy_actor.py::test_tp2_pp2_matches_tp1_pp1)
]


def tiny_spec():
    from dapo_megatron.policy.model_spec import ModelSpec

    return ModelSpec(arch="qwen2", vocab_size=101, hidden_size=48, num_layers=4, num_attention_heads=6,
                     num_kv_heads=2, head_dim=8, ffn_hidden_size=96, rms_norm_eps=1e-6, rope_theta=10000.0,
                     qkv_bias=True, tie_embeddings=False, max_position_embeddings=256)


def train_job(tensor_parallel: int, pipeline_parallel: int, distributed_optimizer: bool):
    import torch
    from actor_harness import actor_settings, loss_of, random_samples
    from megatron.core import parallel_state

    from dapo_megatron.config import OptimConfig, ParallelConfig
    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.policy.actor import build_actor
    from dapo_megatron.policy.packing import PolicySample

    layout = init_distributed(tensor_parallel, pipeline_parallel)
    seed_everything(1234)  # replicas must start from the same weights: megatron draws them on the CPU generator
    actor = build_actor(tiny_spec(), backend=layout.backend, **actor_settings(
        optim=OptimConfig(lr=1e-2, grad_clip=1.0, warmup_steps=0),
        parallel=ParallelConfig(use_distributed_optimizer=distributed_optimizer), micro_batch_tokens=48))
    samples = random_samples(8, seed=5)
    old = actor.compute_logprobs(samples).logprobs  # ratio starts at 1; the loss can only fall by learning
    samples = [PolicySample(s.prompt_ids, s.response_ids, advantage=s.advantage, old_logprobs=o)
               for s, o in zip(samples, old)]
    metrics = [actor.train_minibatch(samples, loss_of()) for _ in range(STEPS)]
    params = torch.cat([p.detach().reshape(-1) for p in actor.model.parameters()]).numpy()
    return dict(
        coords=(parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()),
        dp_rank=parallel_state.get_data_parallel_rank(),
        data_parallel=layout.data_parallel,
        clip_grad=actor.optimizer.config.clip_grad,
        losses=[m["pg_loss"] for m in metrics],
        grad_norms=[m["grad_norm"] for m in metrics],
        skipped=[m["skipped"] for m in metrics],
        params=params,
    )


@pytest.mark.parametrize("tensor_parallel,pipeline_parallel,data_parallel,distributed_optimizer", LAYOUTS)
def test_trains_at_every_layout(tensor_parallel, pipeline_parallel, data_parallel, distributed_optimizer):
    world = tensor_parallel * pipeline_parallel * data_parallel
    ranks = run_distributed(train_job, world, tensor_parallel, pipeline_parallel, distributed_optimizer)
    first = ranks[0]
    assert all(r["data_parallel"] == data_parallel for r in ranks)
    assert first["skipped"] == [0.0] * STEPS
    assert first["losses"][-1] < first["losses"][0] - 0.05, first["losses"]
    assert first["clip_grad"] == 1.0 and first["grad_norms"][0] > 1.0  # clipping engaged on the first step
    for r in ranks:  # every rank reports the same (last-stage, DP-reduced) metrics
        assert r["losses"] == first["losses"] and r["grad_norms"] == first["grad_norms"]
    replicas: dict[tuple, list] = {}
    for r in ranks:
        replicas.setdefault(r["coords"], []).append(r["params"])
    assert len(replicas) == tensor_parallel * pipeline_parallel
    for coords, params in replicas.items():
        assert len(params) == data_parallel
        for other in params[1:]:
            np.testing.assert_array_equal(other, params[0], err_msg=f"DP replicas differ at (tp, pp) = {coords}")


REPO_ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (what it installs or patches stays there), with this checkout importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT, env=env)


def test_cpu_layer_is_installed_only_without_cuda():
    """The decision, in a fresh interpreter: with a CUDA backend, NCCL, the local GPU, and no CPU layer."""
    result = run_python("""
        import torch
        from dapo_megatron.backend_registry import select_backend
        from dapo_megatron.overrides.megatron_core import cpu_compat
        from dapo_megatron.platform import prepare_device

        bound = []
        torch.cuda.set_device = bound.append  # this machine has no GPU to bind
        current_device = torch.cuda.current_device
        cuda = select_backend(cuda_available=True, transformer_engine=True)
        info = prepare_device(cuda, 3, device_count=8)
        assert info.collective == "nccl" and info.device == torch.device("cuda", 3), info
        assert not cpu_compat.is_installed()
        assert bound == [3] and torch.cuda.current_device is current_device
        info = prepare_device(cuda, 3, device_count=1)  # SLURM bound one GPU to this task
        assert info.device == torch.device("cuda", 0) and bound == [3, 0], (info, bound)

        info = prepare_device(select_backend(), 0)  # the real answer here: no CUDA
        assert info.collective == "gloo" and info.device == torch.device("cpu")
        assert cpu_compat.is_installed() and torch.cuda.current_device() == "cpu"
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_world_size_that_is_not_tp_pp_dp_is_an_error():
    from dapo_megatron.platform import LaunchError, init_distributed

    with pytest.raises(LaunchError, match=r"world size 4 != .* 2 × 1 × 3 = 6"):
        init_distributed(2, 1, 3, environ={"RANK": "0", "WORLD_SIZE": "4"})
    with pytest.raises(LaunchError, match="world size 6 is not divisible by .* 2 × 2 = 4"):
        init_distributed(2, 2, environ={"RANK": "0", "WORLD_SIZE": "6"})


def mismatched_world_job():
    from dapo_megatron.platform import init_distributed

    init_distributed(2, 2)  # a world of 2 launched for TP=2 × PP=2


def test_mismatched_launch_fails_on_every_rank_instead_of_hanging():
    with pytest.raises(RuntimeError, match="world size 2 is not divisible"):
        run_distributed(mismatched_world_job, 2, timeout_s=120)


def test_taken_rendezvous_port_is_an_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_python(f"""
            from dapo_megatron.platform import LaunchError, init_distributed
            try:
                init_distributed(1, 1, environ={{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"}})
            except LaunchError as error:
                print(error)
        """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"rendezvous port {port} on 127.0.0.1 is already in use" in result.stdout
