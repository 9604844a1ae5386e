"""A trainer checkpoint with megatron's distributed optimizer at DP=2 (the default optimizer, and what the 32B
example runs) saves and restores exactly: the Adam moments and fp32 main weights each DP rank holds come back."""

from __future__ import annotations

import pytest

from trainer_harness import build_trainer

pytestmark = pytest.mark.slow

OVERRIDES = ["warm_start.enabled=false", "data.synthetic.num_train=200", "data.synthetic.num_heldout=8",
             "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
             "parallel.use_distributed_optimizer=true", "algorithm.dynamic_sampling=false",
             "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
             "rollout.max_response_length=16", "eval.max_problems=4"]


def _optimizer_tensors(optimizer) -> dict:
    """This rank's optimizer state as tensors by a stable key: for every parameter the inner torch optimizer steps
    (the fp32 main shard this DP rank owns), the parameter itself and its Adam state (moments, step count). The
    distributed optimizer's own ``state_dict()`` holds none of these: they travel in the sharded checkpoint."""
    import torch

    flat = {}
    for i, chained in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = chained.optimizer
        for g, group in enumerate(inner.param_groups):
            for j, param in enumerate(group["params"]):
                flat[f"{i}/{g}/{j}/param"] = param.detach().clone()
                for name, value in inner.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        flat[f"{i}/{g}/{j}/{name}"] = value.detach().clone()
    return flat


def _save_train_restore(overrides: list[str]) -> dict:
    import torch

    trainer = build_trainer(overrides)
    try:
        trainer.hand_off_weights(version=0)
        trainer.train_step(0)
        trainer.save(1)
        saved = _optimizer_tensors(trainer.actor.optimizer)
        trainer.train_step(1)  # moves every moment and main weight away from the checkpoint
        moved = _optimizer_tensors(trainer.actor.optimizer)
        step = trainer.restore()
        restored = _optimizer_tensors(trainer.actor.optimizer)
    finally:
        trainer.shutdown()
    differs = lambda a, b: sorted(k for k in a if not torch.equal(a[k], b[k]))  # noqa: E731
    return {"step": step, "keys": len(saved), "moved": differs(saved, moved), "not_restored": differs(saved, restored)}


def test_distributed_optimizer_checkpoint_round_trips_at_dp2(tmp_path):
    from spawn_ranks import run_distributed

    results = run_distributed(_save_train_restore, 2, [*OVERRIDES, f"trainer.run_dir={tmp_path}"], timeout_s=900)
    for rank in results:
        assert rank["step"] == 1
        assert rank["keys"] > 0 and rank["moved"], "control: a training step must change the optimizer state"
        assert rank["not_restored"] == [], rank["not_restored"]
