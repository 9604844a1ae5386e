"""Issue 33.1: ``dapo-megatron train ... 2>&1 | tee log`` signalled as a process group — what a terminal (Ctrl-C,
hangup), ``kill -- -PGID``, systemd and batch systems do. ``tee`` dies with the trainer, so the trainer's next write
finds no reader. Real processes: the trainer leads a new session and ``tee`` joins its process group through a real
pipe; the group gets the signal."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from cli_runs import REPO, cli_command, cli_env, read_run_metrics
from test_run_reliability import WatchedRun, _train

from dapo_megatron.checkpoint import checkpoint_problems, list_checkpoints
from dapo_megatron.run.stop_signals import INTERRUPTED_EXIT_CODE, STOPPED_EXIT_CODE

pytestmark = pytest.mark.slow


class TeedRun(WatchedRun):
    """``bash -c 'dapo-megatron train ... 2>&1 | tee log'`` leading a session of its own: the trainer and ``tee`` are
    in bash's process group, joined by a real pipe. bash traps the signals (a trap, unlike an ignored signal, is not
    inherited) so that it outlives the pipeline and records the trainer's exit status."""

    def __init__(self, args: list[str], log: Path):
        self.log, self.rc_file = log, log.with_name("trainer.rc")
        script = f'trap true TERM HUP INT; "$@" 2>&1 | tee {log}; echo ${{PIPESTATUS[0]}} > {self.rc_file}'
        self.proc = subprocess.Popen(["bash", "-c", script, "bash", *cli_command(*args)], env=cli_env(), cwd=REPO,
                                     start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.output, self.eof_at, self.seen = [], None, {}
        self._done = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def finish(self, timeout: float = 180) -> int:
        super().finish(timeout)
        return int(self.rc_file.read_text())

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@pytest.mark.parametrize("signum, expected_rc", [(signal.SIGTERM, STOPPED_EXIT_CODE),
                                                 (signal.SIGHUP, STOPPED_EXIT_CODE),
                                                 (signal.SIGINT, INTERRUPTED_EXIT_CODE)],
                         ids=["sigterm", "sighup", "ctrl-c"])
def test_a_signal_to_the_process_group_of_a_piped_run_keeps_its_checkpoint_and_exit_code(tmp_path, signum,
                                                                                          expected_rc):
    """Once step 3 is logged, the group gets the signal; tee dies at once. SIGTERM and SIGHUP: the step in progress
    is finished, its summary line written into the dead pipe, its checkpoint saved, exit 75; Ctrl-C: exit 130 with
    every complete checkpoint whole. The output after tee's death is in the run directory's console.log; nothing of
    the run survives and the lock is gone. Before: the summary line raised BrokenPipeError (exit 1, no checkpoint);
    Ctrl-C exited 1; SIGHUP exited 129 at once, without a checkpoint, leaving the lock."""
    run_dir = tmp_path / "run"
    run = TeedRun(_train(run_dir, "trainer.total_steps=30", "trainer.save_every=2"), tmp_path / "log")
    metrics = run_dir / "metrics.jsonl"
    run.wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 4, "step 3's metrics")
    run.signal(signum, group=True)
    rc = run.finish()
    console = (run_dir / "console.log").read_text() if (run_dir / "console.log").exists() else ""
    assert rc == expected_rc, (rc, run.text()[-2000:], console[-2000:])
    time.sleep(0.5)
    assert run.survivors() == [], run.survivors()
    assert not (run_dir / "run.lock").exists()
    complete = list_checkpoints(run_dir / "checkpoints")
    assert complete and all(checkpoint_problems(path, world_size=1) == [] for path in complete)
    assert "step 1/30" in run.text()  # tee copied the run's output until the signal killed it
    assert "Traceback" not in console + run.text(), (console + run.text())[-3000:]
    if signum == signal.SIGINT and not console:
        # Ctrl-C stops the trainer at once: on a loaded machine its last line can reach the pipe before tee has
        # died (then tee may copy it, or die with it unread), so nothing is written after the reader is gone.
        return
    assert "its reader is gone" in console, console[-3000:]
    if signum != signal.SIGINT:
        last = read_run_metrics(run_dir)[-1]["step"]
        assert complete[-1].name == f"step_{last:06d}" and last >= 3  # the step reached
        assert f"stopped by {signal.Signals(signum).name} after step {last}" in console
    else:
        assert "interrupted (Ctrl-C); `--resume` continues from" in console
