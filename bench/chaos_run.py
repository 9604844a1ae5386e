"""One ``dapo-megatron train`` job under ``torchrun --max-restarts`` with ``trainer.auto_resume=true``, watched from
outside the way bench/chaos.py needs: which processes play which part (trainer ranks, reward workers, SGLang
servers, sandbox calls), how far the run got, and when the processes a fault hit are gone.

Everything is read from what a user could see: the process tree (psutil; a rank by its RANK variable), the run
directory's ``metrics.jsonl``, ``faults.jsonl`` and ``restarts.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def free_port() -> int:
    from dapo_megatron.launch_env import free_port as free

    return free()


class JobRun:
    """``torchrun --nproc_per_node ranks --max-restarts restarts -m dapo_megatron.cli train config overrides``, its
    output copied to ``<run_dir>.log`` by a reader thread; ``close_output()`` stops reading it (a dead ``| tee``)."""

    def __init__(self, config: Path, run_dir: Path, overrides: list[str], *, ranks: int, restarts: int):
        self.run_dir = Path(run_dir)
        self.log = self.run_dir.with_name(self.run_dir.name + ".log")
        self.command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                        "--max-restarts", str(restarts), "--monitor-interval", "0.5", "--master_port",
                        str(free_port()), "-m", "dapo_megatron.cli", "train", str(config),
                        f"trainer.run_dir={self.run_dir}", "trainer.auto_resume=true",
                        f"trainer.max_restarts={restarts}", *overrides]
        self.started = time.monotonic()
        self.process = subprocess.Popen(self.command, cwd=REPO, env=env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self._reading = True
        self._reader = threading.Thread(target=self._copy_output, daemon=True)
        self._reader.start()

    def _copy_output(self) -> None:
        with open(self.log, "wb") as copy:
            for line in self.process.stdout:
                if not self._reading:
                    break
                copy.write(line)
                copy.flush()
        self.process.stdout.close()  # from now on every write of the job finds no reader

    def close_output(self) -> None:
        """Stop reading the job's stdout and close it at the next line: its reader is gone, as a killed ``tee``."""
        self._reading = False

    # ------------------------------------------------------------------------------------------------ progress

    def steps(self) -> list[int]:
        """The steps logged in ``metrics.jsonl`` so far (a torn last line skipped)."""
        path = self.run_dir / "metrics.jsonl"
        steps = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                steps.append(json.loads(line)["step"])
            except (ValueError, KeyError):
                continue
        return steps

    def wait_for_step(self, step: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while max(self.steps(), default=-1) < step:
            if self.process.poll() is not None:
                raise RuntimeError(f"the job ended (code {self.process.returncode}) before step {step}: {self.log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no step {step} within {timeout_s:.0f} s: {self.log}")
            time.sleep(0.05)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            self._reader.join(timeout=10)

    def kill(self) -> None:
        """Everything the job started, at once (a bench that failed must not leave it running)."""
        for member in self.members():
            try:
                member.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    # ------------------------------------------------------------------------------------------------ processes

    def members(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def ranks(self) -> dict[int, psutil.Process]:
        """The trainer ranks of the attempt running now, by rank."""
        found = {}
        for child in self._children(self.process.pid):
            try:
                rank = child.environ().get("RANK")
            except psutil.Error:
                continue
            if rank is not None and "dapo_megatron.cli" in " ".join(child.cmdline()):
                found[int(rank)] = child
        return found

    def helpers(self, part: str) -> list[psutil.Process]:
        """Rank 0's helper processes playing ``part``: ``reward`` workers, ``sglang`` servers (their launcher
        process), ``sandbox`` calls (bubblewrap, each a session of its own)."""
        rank0 = self.ranks().get(0)
        if rank0 is None:
            return []
        wanted = {"reward": "multiprocessing.spawn", "sglang": "sglang.launch_server", "sandbox": "bwrap"}[part]
        found = []
        for child in self._children(rank0.pid):
            try:
                line = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if wanted in line and (part != "reward" or "resource_tracker" not in line):
                found.append(child)
        return found

    @staticmethod
    def _children(pid: int) -> list[psutil.Process]:
        try:
            return psutil.Process(pid).children()
        except psutil.NoSuchProcess:
            return []


def gone(process: psutil.Process) -> bool:
    """Whether ``process`` has ended and been reaped by its parent (a zombie is not gone: nobody noticed yet)."""
    try:
        return process.status() == psutil.STATUS_DEAD
    except psutil.NoSuchProcess:
        return True


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows
