"""``dapo-megatron`` run as a user runs it — a subprocess of this interpreter — and what a run leaves behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny_cpu.yaml"
TIMINGS = ("timing_s/", "timing_cpu_s/", "perf/throughput")  # clock readings: the only numbers a rerun may change


def cli_command(*args: str, module: str = "dapo_megatron.cli") -> list[str]:
    return [sys.executable, "-m", module, *args]


def cli_env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def run_cli(*args: str, env: dict | None = None, timeout: float = 900,
            module: str = "dapo_megatron.cli") -> subprocess.CompletedProcess:
    return subprocess.run(cli_command(*args, module=module), capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env=cli_env(**(env or {})))


def check_run(*args: str, timeout: float = 900, module: str = "dapo_megatron.cli") -> subprocess.CompletedProcess:
    result = run_cli(*args, timeout=timeout, module=module)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def read_run_metrics(run_dir: Path, *, timings: bool = False) -> list[dict]:
    """The rows of ``metrics.jsonl``, without the clock readings unless asked."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return rows if timings else [{k: v for k, v in row.items() if not k.startswith(TIMINGS)} for row in rows]


def kill_after_checkpoint(command: list[str], run_dir: Path, step: int, timeout_s: float = 900) -> None:
    """Start ``command``, SIGKILL its whole process group as soon as checkpoint ``step`` is complete."""
    proc = subprocess.Popen(command, env=cli_env(), cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "COMPLETE"
    deadline = time.monotonic() + timeout_s
    try:
        while not marker.exists():
            assert proc.poll() is None, f"the run ended before writing its step-{step} checkpoint"
            assert time.monotonic() < deadline, f"no step-{step} checkpoint within {timeout_s:.0f} s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
