"""Issue 25 end to end, with the CLI as a user runs it (tiny model, no warm start, so the built-in rule finds every
answer wrong): a verl reward file changes training, a hanging reward is timed out and counted while the run
finishes, a two-source mixture is drawn in proportion and resumes exactly, the soft format bonus decays in the
metrics next to the validation generations, and W&B (offline) and MLflow hold metrics.jsonl's scalars."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
from cli_runs import TINY, check_run, cli_command, kill_after_checkpoint, read_run_metrics
from logger_readers import mlflow_history, wandb_offline_history

from dapo_megatron.data.dapo_math import write_jsonl
from dapo_megatron.data.synthetic import make_split
from dapo_megatron.metrics.loggers import IDS_FILE, mlflow_metric_name

pytestmark = pytest.mark.slow

SMALL = ["warm_start.enabled=false", "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
         "data.synthetic.num_train=200", "data.synthetic.num_heldout=8", "eval.every=0",
         "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4", "model.tiny.hidden_size=32",
         "model.tiny.num_layers=2", "model.tiny.intermediate_size=64", "reward.num_workers=2"]
ONE_ROUND = ["algorithm.dynamic_sampling=true", "algorithm.gen_batch_size=4", "algorithm.max_gen_rounds=1"]


def _train(run_dir, *extra: str) -> list[str]:
    return ["train", str(TINY), *SMALL, f"trainer.run_dir={run_dir}", *extra]


def _reward_file(tmp_path, body: str) -> str:
    path = tmp_path / "reward.py"
    path.write_text(textwrap.dedent(body))
    return f"reward.function={path}:compute_score"


def test_a_verl_reward_file_changes_training(tmp_path):
    """+1 for everything: every group is all-correct, so dynamic sampling filters them all; the built-in rule (the
    control) finds every answer of the random model wrong."""
    plus_one = _reward_file(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
    """)
    check_run(*_train(tmp_path / "plus_one", "trainer.total_steps=1", *ONE_ROUND, plus_one))
    check_run(*_train(tmp_path / "builtin", "trainer.total_steps=1", *ONE_ROUND))
    (mine,), (builtin,) = read_run_metrics(tmp_path / "plus_one")[1:], read_run_metrics(tmp_path / "builtin")[1:]
    assert mine["train/filter/all_correct_fraction"] == 1.0 and mine["train/filter/kept_fraction"] == 0.0
    assert builtin["train/filter/all_correct_fraction"] == 0.0 and builtin["train/filter/all_wrong_fraction"] == 1.0
    assert mine["reward/errors"] == mine["reward/timeouts"] == 0.0  # the control of the next test's counts


def test_a_hanging_reward_is_timed_out_and_counted_while_the_run_finishes(tmp_path):
    hangs = _reward_file(tmp_path, """
        import time

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if len(solution_str) % 3 == 0:
                time.sleep(3600)
            if len(solution_str) % 3 == 1:
                raise ValueError("cannot grade this")
            return 1.0
    """)
    # ~2/3 of the responses fail, above the default reward.max_error_fraction (which would stop the run: exit 8,
    # tests/unit/test_reward_failures.py): 1 lets it finish, to count them
    result = check_run(*_train(tmp_path, "trainer.total_steps=2", "algorithm.dynamic_sampling=false",
                               "reward.timeout_s=1", "reward.max_error_fraction=1", hangs))
    rows = read_run_metrics(tmp_path)[1:]
    assert [row["step"] for row in rows] == [1, 2]
    assert sum(row["reward/timeouts"] for row in rows) > 0 and sum(row["reward/errors"] for row in rows) > 0
    # shown once (the first ones come from the validation before step 1), then only counted
    assert result.stderr.count(" timed out on ") == 1 and result.stderr.count(" failed on ") == 1
    assert "reward.py:compute_score" in result.stderr and "ValueError: cannot grade this" in result.stderr


def _two_sources(tmp_path) -> list[str]:
    rows = make_split(seed=0, n_train=200, n_heldout=0).train_rows()
    for kind in ("mul", "chain"):
        write_jsonl([{**row, "data_source": f"arith-{kind}"} for row in rows if row["extra_info"]["kind"] == kind],
                    tmp_path / f"{kind}.jsonl")
    return ["data.source=dapo_math", f"data.val_files=[{tmp_path / 'chain.jsonl'}]", "eval.max_problems=4",
            f"data.train=[{{path: {tmp_path / 'chain.jsonl'}, weight: 3}}, "
            f"{{path: {tmp_path / 'mul.jsonl'}, weight: 1}}]"]


def test_a_two_source_mixture_is_drawn_in_proportion_and_resumes_exactly(tmp_path):
    """Weights 3:1, 4 prompts per step (no dynamic sampling: one round of a batch): every step draws exactly 3 and 1
    (the tolerance: each source within one prompt of its share at every draw); SIGKILL after step 2 + --resume logs
    the uninterrupted run's metrics."""
    mixture = [*_two_sources(tmp_path), "algorithm.dynamic_sampling=false", "trainer.total_steps=4",
               "trainer.save_every=2"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    check_run(*_train(straight, *mixture))
    expected = read_run_metrics(straight)
    for row in expected[1:]:
        assert (row["rollout/source/arith-chain/groups"], row["rollout/source/arith-mul/groups"]) == (3.0, 1.0)
    kill_after_checkpoint(cli_command(*_train(killed, *mixture)), killed, step=2)
    check_run(*_train(killed, *mixture), "--resume")
    assert read_run_metrics(killed) == expected


def test_the_decaying_format_bonus_and_the_validation_generations(tmp_path):
    check_run(*_train(tmp_path, "trainer.total_steps=3", "algorithm.dynamic_sampling=false",
                      "reward.format.weight=0.5", "reward.format.decay_steps=2", "eval.log_generations=3"))
    rows = read_run_metrics(tmp_path)
    assert [row.get("reward/format/weight") for row in rows] == [None, 0.5, 0.25, 0.0]
    assert all(0 <= row["reward/format/match_rate"] <= 1 and "response/reflection_rate" in row for row in rows[1:])
    generations = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert [g["step"] for g in generations] == [0, 0, 0, 3, 3, 3]  # before training and after the last step
    assert {"prompt", "response", "ground_truth", "score", "acc"} <= generations[0].keys()
    check_run("plot", str(tmp_path))
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_wandb_offline_and_mlflow_runs_hold_the_scalars_of_metrics_jsonl(tmp_path):
    check_run(*_train(tmp_path, "trainer.total_steps=2", "algorithm.dynamic_sampling=false",
                      "trainer.loggers=[tensorboard, wandb, mlflow]", "trainer.wandb.mode=offline"))
    expected = {row.pop("step"): {k: v for k, v in row.items() if isinstance(v, (int, float)) and math.isfinite(v)}
                for row in read_run_metrics(tmp_path, timings=True)}
    assert len(expected) == 3 and len(expected[1]) > 40
    wandb_rows = wandb_offline_history(tmp_path)
    assert {step: {k: v for k, v in row.items() if not k.startswith(("_", "val/generations/"))}
            for step, row in wandb_rows.items()} == expected
    run_id = json.loads((tmp_path / IDS_FILE).read_text())["mlflow_run_id"]
    assert mlflow_history(f"sqlite:///{tmp_path / 'mlflow.db'}", run_id) == {
        step: {mlflow_metric_name(k): v for k, v in row.items()} for step, row in expected.items()}
