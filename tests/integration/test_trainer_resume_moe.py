"""Exact resume with expert parallelism: a tiny Qwen3-MoE trained on 2 ranks with its experts split over both (EP=2,
π_old's routing replayed, R2; or the engine's, R3) for 4 steps, and the same run SIGKILLed after its step-2
checkpoint and resumed, log identical metrics — routing statistics included. Runs the CLI under torchrun as a user
would. The replicated optimizer: with megatron's distributed optimizer on CPU (torch Adam), megatron-core 0.16.1
cannot load an optimizer checkpoint into a fresh process at all, dense or MoE (``DistributedOptimizer.state_dict``
asserts one Adam step count among zero states)."""

from __future__ import annotations

import pytest
from cli_runs import TINY, check_run, cli_command, kill_after_checkpoint, read_run_metrics

from dapo_megatron.launch_env import free_port

pytestmark = pytest.mark.slow

MOE = ["model.tiny.arch=qwen3_moe", "model.tiny.hidden_size=32", "model.tiny.num_layers=2",
       "model.tiny.head_dim=16", "model.tiny.num_experts=4", "model.tiny.num_experts_per_tok=2",
       "model.tiny.moe_intermediate_size=32", "parallel.expert=2", "parallel.use_distributed_optimizer=false"]
OVERRIDES = ["warm_start.enabled=false", "trainer.total_steps=4", "trainer.save_every=2",
             "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
             "data.synthetic.num_train=200", "data.synthetic.num_heldout=8", "eval.every=0",
             "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4", "algorithm.dynamic_sampling=false",
             *MOE]


def _train(run_dir, replay: str, *extra: str) -> list[str]:
    return ["--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "dapo_megatron.cli", "train", str(TINY),
            *OVERRIDES, f"algorithm.moe_routing_replay={replay}", f"trainer.run_dir={run_dir}", *extra]


@pytest.mark.parametrize("replay", ["replay_old", "replay_rollout"])
def test_sigkill_then_resume_with_expert_parallelism_logs_identical_metrics(tmp_path, replay):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    check_run(*_train(straight, replay), module="torch.distributed.run", timeout=1500)
    kill_after_checkpoint(cli_command(*_train(killed, replay), module="torch.distributed.run"), killed, step=2,
                          timeout_s=1500)
    assert not (killed / "checkpoints" / "step_000004").exists()
    check_run(*_train(killed, replay), "--resume", module="torch.distributed.run", timeout=1500)
    expected, resumed = read_run_metrics(straight), read_run_metrics(killed)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert all("actor/moe_aux_loss" in row for row in expected[1:])
    if replay == "replay_rollout":  # the engine's routing was replayed, and what it bought is logged
        assert all("rollout/routing_agreement" in row for row in expected[1:])
    assert resumed == expected
