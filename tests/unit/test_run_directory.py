"""The run directory's lock and who may start a run in it (dapo_megatron/run/lock.py, run_directory.py):
real processes for liveness and for racing newcomers, lock files of another host for the heartbeat path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dapo_megatron.config import ConfigError
from dapo_megatron.run.directory import claim_run_directory, existing_run
from dapo_megatron.run.lock import LOCK_FILE, RunLock, process_start

REPO = Path(__file__).resolve().parents[2]


def _lock_record(**fields) -> dict:
    record = {"host": "node-b", "pid_space": "other-boot/pid:[1]", "pid": 4242, "pid_start": "1", "token": "t0",
              "started": "2026-12-01T00:00:00+00:00", "command": "dapo-megatron train x.yaml", "heartbeat": 0}
    return {**record, **fields}


def _write_lock(run_dir: Path, record: dict) -> None:
    (run_dir / LOCK_FILE).write_text(json.dumps(record) + "\n")


def test_a_held_lock_refuses_a_second_holder_and_is_gone_after_release(tmp_path):
    first = RunLock(tmp_path).acquire()
    try:
        with pytest.raises(ConfigError, match=rf"trainer.run_dir: {tmp_path} is in use by another process \(pid "
                                              rf"{os.getpid()} on host "):
            RunLock(tmp_path).acquire()
    finally:
        first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    RunLock(tmp_path).acquire().release()  # free again


def test_lock_of_a_process_that_is_gone_is_taken_over(tmp_path, caplog):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start(gone.pid)
    gone.wait()
    _write_lock(tmp_path, _lock_record(pid_space=RunLock(tmp_path).owner["pid_space"], pid=gone.pid,
                                       pid_start=start))
    lock = RunLock(tmp_path).acquire()
    try:
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert f"taking over the lock left by a process that is gone (pid {gone.pid}" in caplog.text
    finally:
        lock.release()


def test_lock_of_a_live_process_on_this_host_is_respected_unless_its_pid_was_reused(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        here = {"pid_space": RunLock(tmp_path).owner["pid_space"], "pid": alive.pid}  # any host name: same pids
        _write_lock(tmp_path, _lock_record(**here, pid_start=process_start(alive.pid)))
        with pytest.raises(ConfigError, match=f"pid {alive.pid} on host"):
            RunLock(tmp_path).acquire()
        # The same pid, started at another time: the process that wrote the lock is gone, its pid reused.
        _write_lock(tmp_path, _lock_record(**here, pid_start="12345"))
        RunLock(tmp_path).acquire().release()
    finally:
        alive.kill()
        alive.wait()


def test_lock_of_another_host_is_alive_while_its_heartbeat_moves(tmp_path):
    _write_lock(tmp_path, _lock_record())
    stop = threading.Event()

    def beat():  # the owner on node-b renewing its lock, as RunLock._beat does
        count = 0
        while not stop.wait(0.1):
            count += 1
            tmp = tmp_path / ".beat.tmp"
            tmp.write_text(json.dumps(_lock_record(heartbeat=count)) + "\n")
            os.replace(tmp, tmp_path / LOCK_FILE)

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(ConfigError, match="pid 4242 on host node-b"):
            RunLock(tmp_path, stale_after_s=1.0).acquire()
    finally:
        stop.set()
        beating.join()
    start = time.monotonic()
    lock = RunLock(tmp_path, stale_after_s=1.0).acquire()  # the heartbeat stopped: node-b's owner is gone
    lock.release()
    assert 1.0 <= time.monotonic() - start < 10


def test_racing_processes_get_the_lock_one_at_a_time(tmp_path):
    """Six processes released at the same instant onto a free lock: exactly one holds it."""
    go = time.time() + 3
    code = (f"import time, sys; from dapo_megatron.run.lock import RunLock\n"
            f"time.sleep(max(0, {go} - time.time()))\n"
            f"try:\n    lock = RunLock(sys.argv[1]).acquire()\nexcept Exception:\n    print('busy'); sys.exit(0)\n"
            f"print('got', flush=True); time.sleep(2); lock.release()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(6)]
    outcomes = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outcomes == ["busy"] * 5 + ["got"], outcomes


def _finished_run(run_dir: Path) -> None:
    step = run_dir / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("4\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    (run_dir / "config.yaml").write_text("trainer: {}\n")


def test_train_refuses_a_directory_holding_a_run_and_overwrite_moves_it_aside(tmp_path):
    run_dir = tmp_path / "run"
    _finished_run(run_dir)
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"holds a run \(1 complete checkpoints, the newest step_000004; 5 metrics "
                                          r"rows up to step 4\); pass --resume to continue it, --overwrite"):
        claim_run_directory(run_dir, resume=False, overwrite=False)
    assert {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    claim_run_directory(run_dir, resume=True, overwrite=False).release()  # continuing it is fine
    lock = claim_run_directory(run_dir, resume=False, overwrite=True)
    try:
        (aside,) = tmp_path.glob("run.replaced-*")
        assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == before
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]
        assert existing_run(run_dir) is None
    finally:
        lock.release()


def test_a_directory_without_steps_or_rows_holds_no_run(tmp_path):
    (tmp_path / "initial_model").mkdir()  # prepare-tiny's output, or a run killed before its first row
    (tmp_path / "config.yaml").write_text("trainer: {}\n")
    (tmp_path / "metrics.jsonl").write_text("")
    assert existing_run(tmp_path) is None
    (tmp_path / "checkpoints" / "step_000002.tmp").mkdir(parents=True)  # a checkpoint being written is a run
    assert "0 complete checkpoints" in existing_run(tmp_path)


def test_resume_and_overwrite_exclude_each_other(tmp_path):
    with pytest.raises(ConfigError, match="--resume and --overwrite exclude each other"):
        claim_run_directory(tmp_path, resume=True, overwrite=True)


def test_a_run_directory_on_a_full_disk_is_one_line_and_leaves_no_temporary_file(tmp_path):
    """Issue 33.4: the lock's temporary file could not be written: an OSError traceback, and the half-written
    `.run.lock.<token>.tmp` stayed. A 4 KiB tmpfs, filled, in a private mount namespace (real ENOSPC)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=4k tmpfs {disk}"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("needs `unshare -m` and tmpfs mounts (root or user namespaces)")
    claim = ("import sys\nfrom dapo_megatron.config import ConfigError\n"
             "from dapo_megatron.run.directory import claim_run_directory\n"
             f"try:\n    claim_run_directory({str(disk / 'run')!r}, resume=False, overwrite=False).release()\n"
             "except ConfigError as error:\n    print(error)\n    sys.exit(2)\n")
    script = (f"mount -t tmpfs -o size=4k tmpfs {disk} && mkdir {disk}/run && "
              f"(dd if=/dev/zero of={disk}/fill bs=1k 2>/dev/null; true) && "
              f"{sys.executable} -c \"$CLAIM\"; code=$?; ls -A {disk}/run; exit $code")
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                            env={**os.environ, "CLAIM": claim}, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    message, *listing = result.stdout.splitlines()
    assert message.startswith(f"trainer.run_dir: cannot write in {disk / 'run'}: No space left on device (0.0 MiB "
                              f"free there)"), result.stdout
    assert listing == [], listing  # no `.run.lock.*.tmp` left
