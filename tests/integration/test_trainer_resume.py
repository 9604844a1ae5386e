"""Exact resume: a 4-step run, and a run SIGKILLed after its step-2 checkpoint then resumed to step 4, log
identical metrics (everything but clock readings). Runs the CLI as a user would. (With dynamic sampling off the
buffer is always empty; tests/integration/test_trainer_dapo_e2e.py resumes with groups in the buffer.)"""

from __future__ import annotations

import shutil

import pytest
from cli_runs import TINY, check_run, cli_command, kill_after_checkpoint, read_run_metrics

pytestmark = pytest.mark.slow

OVERRIDES = ["warm_start.enabled=false", "trainer.total_steps=4", "trainer.save_every=2",
             "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
             "data.synthetic.num_train=200", "data.synthetic.num_heldout=8", "eval.every=0",
             "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4", "algorithm.dynamic_sampling=false",
             "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64"]


def _train(run_dir, *extra: str) -> list[str]:
    return ["train", str(TINY), *OVERRIDES, f"trainer.run_dir={run_dir}", *extra]


def test_sigkill_then_resume_logs_identical_metrics(tmp_path):
    """With megatron's distributed optimizer (the schema's default), whose Adam state a fresh process must be able to
    load (megatron-core 0.16.1 asserts on the step of a never-stepped torch Adam while building the load). The tiny
    example's plain optimizer is resumed the same way in test_trainer_dapo_e2e.py (with groups in the buffer)."""
    optimizer = "parallel.use_distributed_optimizer=true"
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    check_run(*_train(straight, optimizer))
    kill_after_checkpoint(cli_command(*_train(killed, optimizer)), killed, step=2)
    assert not (killed / "checkpoints" / "step_000004").exists()
    check_run(*_train(killed, optimizer), "--resume")
    expected, resumed = read_run_metrics(straight), read_run_metrics(killed)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert resumed == expected


def test_a_fresh_start_or_a_resume_without_checkpoint_logs_each_step_once(tmp_path):
    """A run killed before its first checkpoint leaves metrics rows behind; starting again in that directory — with
    --resume (nothing to resume from) or with --overwrite (the old run moved aside) — logs each step once, not after
    the old rows."""
    run_dir = tmp_path / "run"
    args = _train(run_dir, "trainer.total_steps=2", "trainer.save_every=0")
    check_run(*args)
    first = read_run_metrics(run_dir)
    for again in (["--resume"], ["--overwrite"]):
        shutil.rmtree(run_dir / "checkpoints")  # as if killed before its first checkpoint
        check_run(*args, *again)
        assert read_run_metrics(run_dir) == first


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_resume_from_a_checkpoint_written_before_the_first_update(tmp_path, distributed_optimizer):
    """Dynamic sampling on a random model keeps no group (every answer is wrong), so the step-1 checkpoint is of an
    optimizer that never stepped, hence has no Adam moments (megatron's distributed optimizer cannot even describe
    that state); saving and resuming from it work and log the uninterrupted run."""
    never_updated = ["algorithm.dynamic_sampling=true", "algorithm.gen_batch_size=4", "algorithm.max_gen_rounds=1",
                     "trainer.total_steps=2", "trainer.save_every=1",
                     f"parallel.use_distributed_optimizer={str(distributed_optimizer).lower()}"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    check_run(*_train(straight, *never_updated))
    expected = read_run_metrics(straight)
    assert expected[1]["train/skipped_empty_batch"] == 1 and "actor/num_updates" not in expected[1]
    kill_after_checkpoint(cli_command(*_train(killed, *never_updated)), killed, step=1)
    shutil.rmtree(killed / "checkpoints" / "step_000002", ignore_errors=True)
    check_run(*_train(killed, *never_updated), "--resume")
    assert read_run_metrics(killed) == expected
