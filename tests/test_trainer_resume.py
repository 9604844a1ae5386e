"""Exact resume: a 4-step run, and a run SIGKILLed after its step-2 checkpoint then resumed to step 4, log
identical metrics (everything but wall-clock timings). Runs the CLI as a user would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

OVERRIDES = ["warm_start.enabled=false", "trainer.total_steps=4", "trainer.save_every=2",
             "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
             "data.synthetic.num_train=200", "data.synthetic.num_heldout=8", "eval.every=0",
             "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4", "algorithm.dynamic_sampling=false",
             "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64"]
WALL_CLOCK = ("timing_s/", "timing_cpu_s/", "perf/throughput")


def _command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dapo_megatron.cli", "train", str(REPO / "examples" / "tiny_cpu.yaml"),
            *OVERRIDES, f"trainer.run_dir={run_dir}", *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(WALL_CLOCK)} for row in rows]


def test_sigkill_then_resume_logs_identical_metrics(tmp_path):
    straight = tmp_path / "straight"
    subprocess.run(_command(straight), check=True, env=_env(), cwd=REPO, timeout=900,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_command(killed), env=_env(), cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = killed / "checkpoints" / "step_000002" / "COMPLETE"
    deadline = time.monotonic() + 900
    while not marker.exists():
        assert proc.poll() is None, "the run ended before writing its step-2 checkpoint"
        assert time.monotonic() < deadline, "no step-2 checkpoint within 900 s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "checkpoints" / "step_000004").exists()

    subprocess.run(_command(killed, "--resume"), check=True, env=_env(), cwd=REPO, timeout=900,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    expected, resumed = _metrics(straight), _metrics(killed)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert resumed == expected
