"""The default DAPO path end to end, with the embedded engine, asserted from the metrics the run logged:

* dynamic sampling keeps some groups and drops others (``train/filter/kept_fraction`` strictly between 0 and 1);
* surplus groups are carried to the next step and trained on there (``algorithm.surplus_policy=keep``);
* a step hits the generation-round cap with a partial, non-empty batch and trains on it;
* SIGKILL after a checkpoint whose buffer holds groups, then ``--resume``: exactly the metrics of the uninterrupted
  run — and the same resume from that checkpoint with its buffer emptied does not give them;
* the last checkpoint exported with ``checkpoint_tools.megatron_to_hf`` is the trained model: a run started from the
  export (``model.source=hf``) measures the same held-out accuracy, and the export carries the tokenizer files.

Each "it happened" check is a function of the metrics that is shown to be false on a run where it does not happen
(dynamic sampling off). Mixed outcomes need a model that is sometimes right: the module warm-starts one tiny model
(~30 s) and every run starts from it (``model.source=hf``). The engine is seeded, so the runs are deterministic.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_runs import TINY, check_run, cli_command, kill_after_checkpoint, read_run_metrics

pytestmark = pytest.mark.slow

TARGET_GROUPS, SAMPLES, STEPS = 4, 4, 8
TASK = ["data.synthetic.num_train=1000", "data.synthetic.num_heldout=16", "rollout.max_response_length=32",
        "algorithm.overlong_buffer_len=4"]
WARM_START = [*TASK, "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128",
              "warm_start.max_steps=300", "warm_start.batch_size=64", "warm_start.stop_at_accuracy=0.15"]
RUN = [*TASK, "warm_start.enabled=false", f"rollout.n_samples={SAMPLES}", f"trainer.train_batch_size={TARGET_GROUPS}",
       "trainer.mini_batch_size=2", "algorithm.dynamic_sampling=true", "algorithm.gen_batch_size=8",
       "algorithm.max_gen_rounds=2", "algorithm.surplus_policy=keep", f"trainer.total_steps={STEPS}",
       "trainer.save_every=1", "trainer.keep_checkpoints=10", "eval.every=0",
       # held-out score: avg@4 of sampled answers, finer-grained than greedy accuracy on 16 problems
       "eval.greedy=false", "eval.n_samples=4", "eval.temperature=1.0", "eval.top_p=1.0"]


# ---- what the metrics say happened ----------------------------------------------------------------------------------
def step_rows(rows: list[dict]) -> list[dict]:
    return [row for row in rows if row["step"] > 0]


def kept_groups(row: dict) -> int:
    """Groups dynamic sampling kept in this step's rounds (kept fraction × groups generated)."""
    generated = row["rollout/num_samples"] / SAMPLES
    return round(row["train/filter/kept_fraction"] * generated)


def buffer_after_each_step(rows: list[dict]) -> list[int]:
    """Groups left in the buffer after each step, kept − trained, accumulated — checked against the batch each step
    trained on, which must be the carried groups plus the new ones, up to the batch size."""
    held, after = 0, []
    for row in step_rows(rows):
        available = held + kept_groups(row)
        assert row["train/num_groups"] == min(TARGET_GROUPS, available), (row["step"], held, kept_groups(row), row)
        held = available - row["train/num_groups"]
        after.append(held)
    return after


def mixed_filtering_steps(rows: list[dict]) -> list[int]:
    return [row["step"] for row in step_rows(rows) if 0 < row["train/filter/kept_fraction"] < 1]


def steps_trained_on_carried_groups(rows: list[dict]) -> list[int]:
    """Steps whose batch holds groups kept in an earlier step (the buffer was not empty when they began)."""
    after = buffer_after_each_step(rows)
    return [row["step"] for row, before in zip(step_rows(rows), [0, *after]) if before > 0]


def capped_steps_trained_on_a_partial_batch(rows: list[dict]) -> list[int]:
    return [row["step"] for row in step_rows(rows)
            if row["train/hit_gen_round_cap"] == 1 and 0 < row["train/num_groups"] < TARGET_GROUPS
            and row.get("actor/num_updates", 0) > 0]


# ---- the runs -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def warm_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("warm") / "initial_model"
    check_run("prepare-tiny", str(TINY), *WARM_START, "--out", str(out))
    return out


def train_args(run_dir: Path, model: Path, *extra: str) -> list[str]:
    return ["train", str(TINY), *RUN, "model.source=hf", f"model.hf_path={model}", f"trainer.run_dir={run_dir}",
            *extra]


@pytest.fixture(scope="module")
def straight(warm_model, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight")
    check_run(*train_args(run_dir, warm_model))
    return run_dir


@pytest.fixture(scope="module")
def without_dynamic_sampling(warm_model, tmp_path_factory) -> list[dict]:
    """The control run: every group is kept, so none is dropped, none is carried and no round cap is hit."""
    run_dir = tmp_path_factory.mktemp("no_dynamic_sampling")
    check_run(*train_args(run_dir, warm_model, "algorithm.dynamic_sampling=false", "trainer.total_steps=2"))
    return read_run_metrics(run_dir)


# ---- the situations -------------------------------------------------------------------------------------------------
def test_dynamic_sampling_keeps_some_groups_and_drops_others(straight, without_dynamic_sampling):
    rows = read_run_metrics(straight)
    assert mixed_filtering_steps(rows), [r.get("train/filter/kept_fraction") for r in rows]
    for row in step_rows(rows):  # what was dropped was all-correct or all-wrong
        fractions = ("kept", "all_correct", "all_wrong")
        assert sum(row[f"train/filter/{name}_fraction"] for name in fractions) == pytest.approx(1.0)
    assert not mixed_filtering_steps(without_dynamic_sampling)  # the control: kept fraction 1 there


def test_surplus_groups_are_carried_to_the_next_step_and_trained_on(straight, without_dynamic_sampling):
    rows = read_run_metrics(straight)
    carried = steps_trained_on_carried_groups(rows)
    assert carried, buffer_after_each_step(rows)
    assert all(rows[step]["actor/num_updates"] > 0 for step in carried)
    assert not steps_trained_on_carried_groups(without_dynamic_sampling)


def test_a_step_at_the_round_cap_trains_on_its_partial_batch(straight, without_dynamic_sampling):
    rows = read_run_metrics(straight)
    capped = capped_steps_trained_on_a_partial_batch(rows)
    assert capped, [(r["train/hit_gen_round_cap"], r["train/num_groups"]) for r in step_rows(rows)]
    for step in capped:
        assert rows[step]["train/num_gen_batches"] == 2 and "train/skipped_empty_batch" not in rows[step]
    assert not capped_steps_trained_on_a_partial_batch(without_dynamic_sampling)


# ---- exact resume with groups in the buffer -------------------------------------------------------------------------
def _empty_the_buffer(checkpoint: Path) -> int:
    state_file = checkpoint / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    held = len(state["collector"]["buffer"]["groups"])
    state["collector"]["buffer"]["groups"] = []
    torch.save(state, state_file)
    return held


def test_sigkill_and_resume_with_groups_in_the_buffer_logs_the_uninterrupted_metrics(straight, warm_model, tmp_path):
    expected = read_run_metrics(straight)
    after = buffer_after_each_step(expected)
    step = next((s for s, held in enumerate(after[:-1], start=1) if held > 0), None)
    assert step is not None, f"no checkpoint holds buffered groups: {after}"

    killed = tmp_path / "killed"
    kill_after_checkpoint(cli_command(*train_args(killed, warm_model)), killed, step)
    for later in (killed / "checkpoints").iterdir():  # resume from `step`, however far the run got before the kill
        if later.name > f"step_{step:06d}":
            shutil.rmtree(later)
    emptied = tmp_path / "emptied"
    shutil.copytree(killed, emptied)

    check_run(*train_args(killed, warm_model), "--resume")
    resumed = read_run_metrics(killed)
    assert [row["step"] for row in resumed] == list(range(STEPS + 1))
    assert resumed == expected

    # The control: the same resume, from the same checkpoint with its buffer emptied, does not log the same numbers.
    assert _empty_the_buffer(emptied / "checkpoints" / f"step_{step:06d}") == after[step - 1]
    check_run(*train_args(emptied, warm_model), "--resume")
    assert read_run_metrics(emptied)[step + 1] != expected[step + 1]


# ---- the exported model ---------------------------------------------------------------------------------------------
def test_the_exported_last_checkpoint_is_the_trained_model(straight, warm_model, tmp_path):
    trained = read_run_metrics(straight)
    score = "val/all/acc/mean@4"
    assert trained[0][score] != trained[-1][score], "training did not move the held-out score: nothing to compare"

    export = tmp_path / "export"
    check_run("--ckpt", str(straight / "checkpoints" / f"step_{STEPS:06d}"), "--out", str(export),
              module="checkpoint_tools.megatron_to_hf")
    side_files = {p.name for p in warm_model.iterdir()} - {"model.safetensors", "COMPLETE", "warm_start.json"}
    assert "chat_template.jinja" in side_files
    for name in sorted(side_files - {"config.json"}):
        assert (export / name).read_bytes() == (warm_model / name).read_bytes(), name
    config, exported_config = (json.loads((d / "config.json").read_text()) for d in (warm_model, export))
    assert {k: v for k, v in exported_config.items() if k != "dtype"} == \
           {k: v for k, v in config.items() if k != "dtype"}

    rerun = tmp_path / "from_export"
    check_run(*train_args(rerun, export, "trainer.total_steps=0"))
    (evaluated,) = read_run_metrics(rerun)
    assert {k: v for k, v in evaluated.items() if k != "step"} == \
           {k: v for k, v in trained[-1].items() if k.startswith("val/")}
