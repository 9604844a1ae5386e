"""The trainer in async mode (``rollout.mode: async``) with the real megatron-core policy and the embedded engine:
a short run (fast set), SIGKILL + ``--resume`` losing no prompt, and the held-out accuracy rise on the tiny task
(slow set)."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer_harness import run_trainer

REPO = Path(__file__).resolve().parents[2]
ASYNC = ["rollout.mode=async", "rollout.max_staleness=1", "algorithm.rollout_correction=token_tis"]


def _tiny(run_dir: Path, *extra: str) -> list[str]:
    return [f"trainer.run_dir={run_dir}", "warm_start.enabled=false", "trainer.train_batch_size=4",
            "trainer.mini_batch_size=2", "rollout.n_samples=4", "data.synthetic.num_train=200",
            "data.synthetic.num_heldout=8", "eval.every=0", "rollout.max_response_length=24",
            "algorithm.overlong_buffer_len=4", "model.tiny.hidden_size=32", "model.tiny.num_layers=2",
            "model.tiny.intermediate_size=64", "algorithm.dynamic_sampling=false", *ASYNC, *extra]


def _balanced(row: dict) -> bool:
    books = {k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith("async/ledger/")}
    return books["drawn"] == books["trained"] + books["filtered"] + books["dropped"] + books["held"]


def test_async_steps_train_within_the_staleness_bound(tmp_path):
    from spawn_ranks import run_distributed

    (result,) = run_distributed(run_trainer, 1, _tiny(tmp_path, "trainer.total_steps=3", "trainer.save_every=0"))
    assert result["changed"] == result["num_params"] and result["version"] == 3
    rows = result["metrics"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        assert row["train/num_groups"] == 4 and row["actor/num_updates"] == 2
        assert row["rollout/staleness/max"] <= 1 and 0 <= row["train/stale_group_fraction"] <= 1
        for key in ("rollout_corr/is_weight_mean", "rollout_corr/kl_k3", "rollout_corr/ratio_max", "async/wait_s",
                    "actor/pg_loss"):
            assert math.isfinite(row[key]), (key, row[key])
        assert _balanced(row)


# ----------------------------------------------------------------------------------------------------- slow set


def _cli(run_dir: Path, *extra: str) -> list[str]:
    # Two batches ahead (max_staleness=2): whenever the step-2 checkpoint is written, the driver holds work.
    return [sys.executable, "-m", "dapo_megatron.cli", "train", str(REPO / "examples" / "tiny_cpu.yaml"),
            *_tiny(run_dir, "trainer.total_steps=4", "trainer.save_every=2", "rollout.max_staleness=2"), *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
def test_async_sigkill_then_resume_loses_no_prompt(tmp_path):
    from dapo_megatron.metrics.writer import read_metrics

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cli(run_dir), env=_env(), cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = run_dir / "checkpoints" / "step_000002"
    deadline = time.monotonic() + 900
    while not (checkpoint / "COMPLETE").exists():
        assert proc.poll() is None, "the run ended before writing its step-2 checkpoint"
        assert time.monotonic() < deadline, "no step-2 checkpoint within 900 s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)["collector"]
    held = len(state["pending_prompts"]) + len(state["buffer"]["groups"])
    assert state["mode"] == "async" and held > 0, "async mode generates ahead: the kill finds work held"

    subprocess.run(_cli(run_dir, "--resume"), check=True, env=_env(), cwd=REPO, timeout=900,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    after_resume = rows[3]
    assert after_resume["async/regenerated_prompts"] == len(state["pending_prompts"])  # reported even when 0
    assert "async/regenerated_prompts" not in rows[4]
    assert after_resume["async/ledger/drawn"] >= state["ledger"]["drawn"]  # the books continue, nothing reset
    assert after_resume["async/ledger/trained"] == state["ledger"]["trained"] + 4
    assert all(_balanced(r) for r in rows[1:])


@pytest.mark.slow
def test_async_mode_raises_held_out_accuracy_on_the_tiny_task(tmp_path):
    """The CPU demo (warm-start, then DAPO) in async mode, one step off-policy with token-level TIS.

    The warm-start runs with 2 threads, as the documented demo does on a 2-core machine (README's Quick start: where
    it stops depends on the CPU's float rounding, 0.260 to 0.377 held-out on the machines measured). With 1 thread
    its every-20-steps check stops it later (0.447 held-out), leaving less headroom; from there sync gained +14.3
    points and async +9.3 to +14.3 over runs (async runs differ: which groups meet which weights depends on
    timing)."""
    example = [str(REPO / "examples" / "tiny_cpu_async.yaml"), f"trainer.run_dir={tmp_path}"]
    subprocess.run([sys.executable, "-m", "dapo_megatron.cli", "prepare-tiny", *example], check=True,
                   env={**_env(), "OMP_NUM_THREADS": "2"}, cwd=REPO, timeout=7200, capture_output=True)
    result = subprocess.run([sys.executable, "-m", "dapo_megatron.cli", "train", *example], check=True, env=_env(),
                            cwd=REPO, timeout=7200, capture_output=True, text=True)
    line = re.search(r"held-out accuracy: before=([\d.]+) after=([\d.]+)", result.stdout)
    before, after = float(line.group(1)), float(line.group(2))
    print(f"async tiny task: held-out accuracy {before:.3f} -> {after:.3f}")
    assert after - before >= 0.10
