"""Issue 27, tried as a user would, with real ``dapo-megatron train`` processes: a run directory is never clobbered,
signals end a run cleanly (a checkpoint of the step reached, a documented exit code, no process of the run left, its
stdout closed), a resume never mixes runs, and a damaged, full or misfitting checkpoint is one line, not a traceback.
Each case is one to three CLI runs of a small model (~15-25 s each on 2 cores)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from cli_runs import REPO, TINY, check_run, cli_command, cli_env, read_run_metrics, run_cli
from test_user_errors import assert_one_line_error

from dapo_megatron.checkpoint import checkpoint_problems, list_checkpoints
from dapo_megatron.run.stop_signals import INTERRUPTED_EXIT_CODE, STOPPED_EXIT_CODE

pytestmark = pytest.mark.slow

SMALL = ["warm_start.enabled=false", "trainer.train_batch_size=4", "trainer.mini_batch_size=2",
         "rollout.n_samples=4", "data.synthetic.num_train=200", "data.synthetic.num_heldout=8", "eval.every=0",
         "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4", "algorithm.dynamic_sampling=false",
         "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64"]


def _train(run_dir: Path, *extra: str) -> list[str]:
    return ["train", str(TINY), *SMALL, f"trainer.run_dir={run_dir}", *extra]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class WatchedRun:
    """``dapo-megatron train`` in a session of its own, its stdout a pipe (as under ``| tee``), every process it
    starts recorded while it runs, so that what outlives it can be named."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen(cli_command(*args), env=cli_env(), cwd=REPO, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        self.eof_at: float | None = None
        self.seen: dict[int, tuple[float, str]] = {}  # pid -> (create time, command line)
        self._done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
        self.eof_at = time.monotonic()

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def _watch(self) -> None:
        while not self._done.is_set():
            self.record()
            time.sleep(0.01)

    def record(self) -> list[psutil.Process]:
        children = self.children()
        for child in children:
            try:
                self.seen.setdefault(child.pid, (child.create_time(), " ".join(child.cmdline())[:120]))
            except psutil.Error:
                pass
        return children

    def wait_for(self, condition, what: str, timeout: float = 300, poll: float = 0.01) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the run ended before {what}:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"not {what} within {timeout:.0f} s"
            time.sleep(poll)

    def signal(self, signum: int, *, group: bool = False) -> float:
        self.record()
        (os.killpg if group else os.kill)(self.proc.pid, signum)
        return time.monotonic()

    def finish(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._done.set()

    def survivors(self) -> list[str]:
        """Processes of the run still alive (a pid reused since is not counted): what would keep `| tee` open."""
        alive = []
        for pid, (created, command) in self.seen.items():
            try:
                process = psutil.Process(pid)
                if process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid}: {command}")
            except psutil.NoSuchProcess:
                pass
        return alive

    def text(self) -> str:
        return "".join(self.output)

    def stdout_closed_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.eof_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.eof_at is not None


def _checkpoint_complete(run_dir: Path, step: int):
    return lambda: (run_dir / "checkpoints" / f"step_{step:06d}" / "COMPLETE").exists()


def _assert_ended_cleanly(run: WatchedRun, rc: int, expected_rc: int, signalled_at: float, within_s: float) -> None:
    took = time.monotonic() - signalled_at
    assert rc == expected_rc, (rc, run.text()[-3000:])
    assert took < within_s, f"{took:.1f} s from the signal to the exit"
    assert run.stdout_closed_within(10), "the run's stdout stayed open after it exited"
    time.sleep(0.5)
    assert run.survivors() == [], run.survivors()
    assert "Traceback" not in run.text(), run.text()[-3000:]


# ---- signals -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("signum, group, resume", [(signal.SIGTERM, False, True), (signal.SIGTERM, True, False),
                                                   (signal.SIGUSR1, False, False)],
                         ids=["sigterm-then-resume", "sigterm-to-every-process", "sigusr1"])
def test_a_stop_signal_saves_the_step_reached_and_ends_every_process(tmp_path, signum, group, resume):
    """SIGTERM (to the trainer, or to every process of the run as SLURM sends it) or SIGUSR1 once step 6 is logged,
    after the step-5 checkpoint: the step in progress is finished and checkpointed though it is no save step, the run
    exits 75, nothing of it survives, its stdout closes; resumed, it logs what an uninterrupted run logs. Before:
    SIGTERM killed the trainer at once, losing the steps since the last checkpoint, and left megatron's checkpoint
    Manager (made by the step-5 save) and its resource tracker running with the trainer's stdout (`| tee` hung);
    sent to every process, it killed that Manager first, so a checkpoint written after it failed."""
    run_dir = tmp_path / "run"
    args = _train(run_dir, "trainer.total_steps=30", "trainer.save_every=5")
    run = WatchedRun(args)
    metrics = run_dir / "metrics.jsonl"
    run.wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 7, "step 6's metrics")
    signalled = run.signal(signum, group=group)
    _assert_ended_cleanly(run, run.finish(), STOPPED_EXIT_CODE, signalled, within_s=90)
    scheduled, stopped = list_checkpoints(run_dir / "checkpoints")
    last = int(stopped.name.removeprefix("step_"))
    assert scheduled.name == "step_000005" and 6 <= last <= 9, (scheduled, stopped)  # the stop's own checkpoint
    assert f"stopped by {signal.Signals(signum).name} after step {last}; `--resume` continues" in run.text()
    assert [row["step"] for row in read_run_metrics(run_dir)] == list(range(last + 1))
    assert not (run_dir / "run.lock").exists()
    if resume:
        check_run(*args, "--resume")
        straight = tmp_path / "straight"
        check_run(*_train(straight, "trainer.total_steps=30", "trainer.save_every=5"))
        assert read_run_metrics(run_dir) == read_run_metrics(straight)


def _writer_processes(run: WatchedRun) -> bool:
    """megatron's checkpoint writers: forks of the trainer (its own command line), alive only while it writes."""
    trainer_cmd = psutil.Process(run.proc.pid).cmdline()
    for child in run.record():
        try:
            if child.cmdline() == trainer_cmd and child.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:  # it ended meanwhile
            pass
    return False


@pytest.mark.parametrize("moment", ["checkpoint-writer", "mid-step"])
def test_the_first_ctrl_c_ends_the_run_promptly_with_the_newest_checkpoint_whole(tmp_path, moment):
    """Ctrl-C (SIGINT to the whole foreground process group) while megatron's writer processes write a checkpoint,
    or in the middle of a step. Before, in 6 tries during the write: 2 exited, 2 were swallowed (the run went on to
    exit 0) and 2 hung in megatron's ``count_queue.join()`` until a second Ctrl-C. Now the checkpoint being written
    is finished, the run exits 130 within seconds, nothing survives, and every complete checkpoint is whole."""
    run_dir = tmp_path / "run"
    bigger = ["model.tiny.hidden_size=128", "model.tiny.num_layers=3", "model.tiny.intermediate_size=256"]
    run = WatchedRun(_train(run_dir, "trainer.total_steps=40", "trainer.save_every=1", *bigger))
    run.wait_for(_checkpoint_complete(run_dir, 1), "the step-1 checkpoint")
    if moment == "checkpoint-writer":
        run.wait_for(lambda: _writer_processes(run), "megatron's checkpoint writer processes", poll=0.001)
    else:
        time.sleep(0.05)
    signalled = run.signal(signal.SIGINT, group=True)
    # A loaded 2-core machine takes up to ~20 s to exit the interpreter; a swallowed Ctrl-C would run on (exit 0)
    _assert_ended_cleanly(run, run.finish(), INTERRUPTED_EXIT_CODE, signalled, within_s=90)
    assert "interrupted (Ctrl-C); `--resume` continues from" in run.text()
    complete = list_checkpoints(run_dir / "checkpoints")
    assert complete and all(checkpoint_problems(path, world_size=1) == [] for path in complete)


# ---- the run directory ---------------------------------------------------------------------------------------------
def test_a_run_directory_is_never_clobbered(tmp_path):
    """A second `train` into a directory whose run is going on is refused with the owner named, and the first run
    goes on untouched; afterwards `train` without --resume is refused, and --overwrite moves the old run aside
    whole. Before: the second run deleted the first's metric rows and checkpoints, and a later fresh start cut
    metrics.jsonl and lost its checkpoints to retention (keep_checkpoints kept the old run's newer ones)."""
    run_dir = tmp_path / "run"
    args = _train(run_dir, "trainer.total_steps=400", "trainer.save_every=2", "trainer.keep_checkpoints=2")
    first = WatchedRun(args)
    first.wait_for(_checkpoint_complete(run_dir, 2), "the step-2 checkpoint")
    second = run_cli(*args)
    assert first.proc.poll() is None, "the first run ended before the second one was refused"
    assert_one_line_error(second, "config", f"trainer.run_dir: {run_dir} is in use by another process (pid "
                                            f"{first.proc.pid} on host")
    first.signal(signal.SIGTERM)  # end it (tested above): a checkpoint of the step it reached, exit 75
    assert first.finish() == STOPPED_EXIT_CODE, first.text()[-3000:]
    stopped = _files(run_dir)
    steps = [row["step"] for row in read_run_metrics(run_dir)]
    assert steps == list(range(steps[-1] + 1)) and steps[-1] > 2
    newest = f"step_{steps[-1]:06d}"
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")][-1] == newest

    assert_one_line_error(run_cli(*args), "config", f"trainer.run_dir: {run_dir} holds a run (2 complete "
                                                    f"checkpoints, the newest {newest}; {len(steps)} metrics rows up "
                                                    f"to step {steps[-1]})")
    assert _files(run_dir) == stopped
    check_run(*args, "trainer.total_steps=2", "--overwrite")
    (aside,) = tmp_path.glob("run.replaced-*")
    assert _files(aside) == stopped
    assert [row["step"] for row in read_run_metrics(run_dir)] == [0, 1, 2]
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_000002"]


# ---- resume --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    finished = check_run(*_train(run_dir, "trainer.total_steps=4", "trainer.save_every=2"))
    (run_dir.parent / "stderr.txt").write_text(finished.stderr)  # beside the run, which tests compare file by file
    return run_dir


def test_resume_refuses_settings_that_cannot_change_and_records_those_that_may(finished_run, tmp_path):
    before = _files(finished_run)
    args = _train(finished_run, "trainer.total_steps=4", "trainer.save_every=2")
    changed = run_cli(*args, "rollout.n_samples=8", "algorithm.eps_high=0.2", "trainer.seed=1", "--resume")
    assert_one_line_error(changed, "config", f"--resume: the run in {finished_run} (checkpoint step_000004) was "
                                             f"trained with other settings that cannot change mid-run: "
                                             f"rollout.n_samples 4 -> 8, algorithm.eps_high 0.28 -> 0.2, "
                                             f"trainer.seed 0 -> 1")
    below = run_cli(*_train(finished_run, "trainer.total_steps=3"), "--resume")
    assert_one_line_error(below, "config", "trainer.total_steps=3 is below the step of the checkpoint --resume "
                                           "continues from")
    assert _files(finished_run) == before
    # Nothing left to train: the accuracy printed is the checkpoint's (the last row's), and the start is recorded.
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    done = check_run(*_train(copy, "trainer.total_steps=4", "trainer.save_every=3"), "--resume")
    last = read_run_metrics(finished_run)[-1]["val/all/acc/mean@1"]
    assert f"after={last:.4f}" in done.stdout
    history = [json.loads(line) for line in (copy / "config_history.jsonl").read_text().splitlines()]
    assert history[-1]["start"] == "resume" and history[-1]["changed"] == {
        "trainer.save_every": [2, 3], "trainer.run_dir": [str(finished_run), str(copy)]}
    assert read_run_metrics(copy) == read_run_metrics(finished_run)


def test_a_damaged_newest_checkpoint_and_a_torn_metrics_line_fall_back_to_an_exact_resume(finished_run, tmp_path):
    """The newest checkpoint's model shard truncated (a broken copy) and metrics.jsonl's last line torn: --resume
    warns, keeps the damaged checkpoint aside, continues from step 2 and logs exactly the finished run's metrics.
    Before: the damaged checkpoint was loaded (a traceback) and the torn line stopped the resume with another."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    shard = sorted((run_dir / "checkpoints" / "step_000004" / "model").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 5, "actor/pg_lo')
    resumed = check_run(*_train(run_dir, "trainer.total_steps=4", "trainer.save_every=2"), "--resume")
    assert f"is damaged (model/{shard.name} is truncated" in resumed.stderr
    assert "metrics.jsonl: skipped line 6, not a whole metrics row" in resumed.stderr
    assert read_run_metrics(run_dir) == read_run_metrics(finished_run)
    assert (run_dir / "checkpoints" / "step_000004.damaged").is_dir()


# ---- checkpoint errors ---------------------------------------------------------------------------------------------
def _can_mount_tmpfs() -> bool:
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


def test_a_full_disk_during_a_checkpoint_is_one_line_naming_the_folder_and_the_space(tmp_path):
    """The checkpoints folder on a 96 KiB tmpfs (a private mount namespace): the first checkpoint does not fit.
    Before: `[Errno 28]` (or torch's "unexpected pos") inside a 53-line traceback."""
    if shutil.which("unshare") is None or not _can_mount_tmpfs():
        pytest.skip("needs `unshare -m` and tmpfs mounts (root or user namespaces)")
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    command = " ".join(cli_command(*_train(run_dir, "trainer.total_steps=2", "trainer.save_every=2")))
    result = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=96k tmpfs {run_dir}/checkpoints "
                                                          f"&& exec {command}"],
                            capture_output=True, text=True, cwd=REPO, env=cli_env(), timeout=600)
    line = assert_one_line_error(result, "checkpoint", f"no space left for checkpoint step_000002 in "
                                                       f"{run_dir}/checkpoints: ")
    assert " MiB free there, a checkpoint of this run takes about " in line


def test_eval_of_a_checkpoint_of_another_model_shape_is_one_line(tmp_path):
    from tiny_models import TinyQwen2Spec, build_tiny_qwen2

    narrow = build_tiny_qwen2(tmp_path / "narrow", TinyQwen2Spec(hidden_size=32))
    wide = build_tiny_qwen2(tmp_path / "wide", TinyQwen2Spec(hidden_size=64))
    run_dir = tmp_path / "run"
    check_run(*_train(run_dir, "model.source=hf", f"model.hf_path={narrow}", "trainer.total_steps=1"))
    result = run_cli("eval", str(TINY), *SMALL, "model.source=hf", f"model.hf_path={wide}",
                     "--ckpt", str(run_dir / "checkpoints" / "step_000001"))
    assert_one_line_error(result, "checkpoint", f"{run_dir}/checkpoints/step_000001/model does not fit the model, or "
                                                f"is damaged: Global shape mismatch")


def test_a_config_that_trains_nothing_says_so(tmp_path, finished_run):
    """One-token responses cannot hold an answer: every group all wrong, dynamic sampling keeps none, nothing is
    trained. Before: exit 0 and not a word. The control: a run with room for answers says nothing of it."""
    nothing = check_run(*_train(tmp_path / "nothing", "trainer.total_steps=2", "rollout.max_response_length=1",
                                "algorithm.overlong_penalty=false", "algorithm.dynamic_sampling=true",
                                "algorithm.gen_batch_size=4", "algorithm.max_gen_rounds=1"))
    assert ("no step of this run changed the policy: in each of its 2 steps every response was wrong (is "
            "rollout.max_response_length=1 room enough for an answer?), so dynamic sampling kept no group and no "
            "update was made") in nothing.stderr
    assert "no step of this run changed the policy" not in (finished_run.parent / "stderr.txt").read_text()
