"""Can the distributed-optimizer overrides go? (dapo_megatron.overrides.megatron_core.checkpointing; the table is
dapo_megatron/overrides/README.md.) On one rank, with megatron-core's own DistributedOptimizer over torch Adam (the
CPU path, and CUDA without TE/apex), each test runs the upstream code WITHOUT the fix and asserts the defect is still
there — when a new pin fixes it, the test fails and says which override can go — then shows the fix repairs it.

The whole save/resume path with the fixes in place is tests/integration/test_trainer_resume.py's job (and
test_checkpoint_distributed_optimizer.py's at DP=2)."""

from __future__ import annotations

import pytest

from actor_harness import actor_settings, build_test_actor, write_tiny_qwen2
from spawn_ranks import run_distributed

UPSTREAM = "megatron-core 0.16.1"


def _distributed_optimizer_job(hf_dir: str, checkpoint_dir: str) -> dict:
    from pathlib import Path

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from dapo_megatron.checkpoint.save_load import model_sharded_state_dict
    from dapo_megatron.config import ParallelConfig
    from dapo_megatron.overrides.megatron_core.checkpointing import (
        OPTIMIZER_STATE_METADATA,
        give_empty_adam_state,
        reapply_adam_steps,
        write_results_in_this_process,
    )

    actor, _ = build_test_actor(hf_dir, 1, 1, actor_settings(parallel=ParallelConfig(use_distributed_optimizer=True)))
    optimizer = actor.optimizer
    (inner,) = [chained.optimizer for chained in getattr(optimizer, "chained_optimizers", [optimizer])]
    model_state = lambda: model_sharded_state_dict([actor.model])  # noqa: E731
    result = {"adam": type(inner).__name__}

    def describe_for_loading() -> str:
        try:
            optimizer.sharded_state_dict(model_state(), is_loading=True, metadata=OPTIMIZER_STATE_METADATA)
        except AssertionError as error:  # megatron asserts one step among torch Adam's (empty) states
            return f"AssertionError {error}"
        return "ok"

    result["fresh, upstream"] = describe_for_loading()
    saved_state = dict(inner.state)
    give_empty_adam_state(optimizer)
    result["fresh, fixed"] = describe_for_loading()
    inner.state.clear()
    inner.state.update(saved_state)

    def step() -> None:
        for param in actor.model.parameters():
            param.main_grad.fill_(1e-3)
        assert optimizer.step()[0]

    step()
    step()
    try:
        optimizer.sharded_state_dict(model_state())  # megatron's default layout
        result["default layout"] = "ok"
    except CheckpointingException as error:
        result["default layout"] = str(error)
    Path(checkpoint_dir).mkdir()
    write_results_in_this_process()  # not under test here: spares this rank megatron's Manager process
    dist_checkpointing.save(optimizer.sharded_state_dict(model_state(), metadata=OPTIMIZER_STATE_METADATA),
                            checkpoint_dir)
    step()  # three updates now; the checkpoint holds two
    loaded = dist_checkpointing.load(
        optimizer.sharded_state_dict(model_state(), is_loading=True, metadata=OPTIMIZER_STATE_METADATA),
        checkpoint_dir)

    def steps() -> dict:
        per_param = [inner.state[p]["step"] for group in inner.param_groups for p in group["params"]]
        return {"groups": sorted({float(group["step"]) for group in inner.param_groups}),
                "params": sorted({float(s) for s in per_param}),
                "distinct tensors": len({id(s) for s in per_param}), "parameters": len(per_param)}

    with torch.no_grad():
        optimizer.load_state_dict(loaded)
        result["loaded, upstream"] = steps()
        reapply_adam_steps(optimizer)
        result["loaded, fixed"] = steps()
    return result


@pytest.fixture(scope="module")
def distributed_optimizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("overrides_adam")
    hf_dir = write_tiny_qwen2(root / "hf", num_layers=1)
    (result,) = run_distributed(_distributed_optimizer_job, 1, str(hf_dir), str(root / "optimizer"), timeout_s=600)
    assert result["adam"] in ("Adam", "AdamW"), f"the defects are torch Adam's; this optimizer is {result['adam']}"
    return result


def test_can_give_empty_adam_state_go(distributed_optimizer):
    """give_empty_adam_state: a never-stepped torch Adam cannot even describe the state a load would fill."""
    assert distributed_optimizer["fresh, upstream"].startswith("AssertionError"), (
        f"{UPSTREAM}'s DistributedOptimizer describes a never-stepped torch Adam for loading now: "
        "give_empty_adam_state can go")
    assert distributed_optimizer["fresh, fixed"] == "ok"


def test_can_reapply_adam_steps_go(distributed_optimizer):
    """reapply_adam_steps: loading a checkpoint of 2 updates into an optimizer at 3 leaves the per-parameter steps at
    3 (the param groups say 2), all one shared tensor."""
    upstream, fixed = distributed_optimizer["loaded, upstream"], distributed_optimizer["loaded, fixed"]
    assert upstream["groups"] == [2.0]
    assert upstream["params"] == [3.0] or upstream["distinct tensors"] < upstream["parameters"], (
        f"{UPSTREAM}'s DistributedOptimizer.load_state_dict restores torch Adam's per-parameter steps, each its own "
        f"tensor, now ({upstream}): reapply_adam_steps can go")
    assert fixed == {**upstream, "params": [2.0], "distinct tensors": upstream["parameters"]}


def test_can_the_dp_reshardable_layout_go(distributed_optimizer):
    """OPTIMIZER_STATE_METADATA: megatron's default layout builds ShardedTensors that megatron itself rejects."""
    assert "flattened_range is not supported" in distributed_optimizer["default layout"], (
        f"{UPSTREAM}'s default distributed-optimizer layout can be described now "
        f"({distributed_optimizer['default layout']}): the dp_reshardable metadata may go (save and load alike)")
