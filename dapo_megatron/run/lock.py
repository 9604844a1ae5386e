"""One process at a time writes into a run directory: the lock file ``<run_dir>/run.lock``.

The lock names its owner (host, pid space, pid and the pid's start time, the command, a random token) and carries a
heartbeat counter that a thread of the owner rewrites every :data:`HEARTBEAT_S` seconds. It is made with
``link(2)`` of a finished temporary file — atomic on local filesystems and on NFS, and never seen half-written — and
every rewrite is a rename over it. The owner deletes it when it exits by any path Python runs (return, exception, a
signal handled by :mod:`.stop_signals`). A process killed outright (SIGKILL, a lost node) leaves it behind, stale:

* an owner whose pids this process can see — the same kernel (boot id) and PID namespace, whatever the host name
  (nodes of a one-machine test cluster differ only in name and network) — is alive exactly when its pid runs and
  started when the lock says (so a reused pid is not mistaken for it): decided at once;
* any other owner (another machine, another container) is alive when its heartbeat moves: the newcomer watches the
  lock for up to
  :data:`STALE_AFTER_S` seconds. The file's content is compared, not its modification time, which other nodes'
  clocks and NFS attribute caches would make unreliable.

A stale lock is taken over, with a warning naming the dead owner; a live one refuses the newcomer with a
:class:`~dapo_megatron.config.ConfigError` naming the owner. Two newcomers taking over the same stale lock are put
in order by a ``run.lock.takeover`` directory (``mkdir`` is atomic on every shared filesystem).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from dapo_megatron.config import ConfigError

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
HEARTBEAT_S = 5.0
STALE_AFTER_S = 30.0  # six missed heartbeats: a live owner's thread is never held up that long
TAKEOVER_STALE_S = 60.0  # a takeover directory older than this was left by a newcomer that died taking over


def pid_space() -> str | None:
    """Which pids this process sees: the kernel's boot id and this PID namespace (None where /proc does not say)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def describe_owner(owner: dict) -> str:
    return (f"pid {owner.get('pid')} on host {owner.get('host')}, started {owner.get('started')}: "
            f"{owner.get('command', '?')}")


class RunLock:
    """The lock of one run directory, held by this process from :meth:`acquire` to :meth:`release`."""

    def __init__(self, run_dir: str | Path, *, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S):
        self.path = Path(run_dir) / LOCK_FILE
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.owner = {"host": socket.gethostname(), "pid_space": pid_space(), "pid": os.getpid(),
                      "pid_start": process_start(os.getpid()), "token": secrets.token_hex(8),
                      "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "command": " ".join(["dapo-megatron", *sys.argv[1:]])[:300], "heartbeat": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ taking it

    def acquire(self) -> "RunLock":
        """Take the lock, or raise a ConfigError naming the live process that holds it."""
        for _ in range(5):
            if self._create():
                self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
                self._thread.start()
                return self
            holder = self._read()
            if holder is None:  # released (or being rewritten) meanwhile: try again
                time.sleep(0.05)
                continue
            if self._alive(holder):
                raise ConfigError(f"trainer.run_dir: {self.path.parent} is in use by another process "
                                  f"({describe_owner(holder)}); wait for it to end, or choose another trainer.run_dir")
            logger.warning("%s: taking over the lock left by a process that is gone (%s)", self.path,
                           describe_owner(holder))
            self._take_over(holder)
        raise ConfigError(f"trainer.run_dir: {self.path.parent}: could not take {self.path} (other processes keep "
                          f"taking it); try again")

    def _create(self) -> bool:
        """Make the lock with our record in it, unless one exists."""
        tmp = self._write_tmp()
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # NFS can fail a link that happened (a retransmitted request): the link count tells
            return tmp.stat().st_nlink == 2
        finally:
            tmp.unlink(missing_ok=True)

    def _write_tmp(self) -> Path:
        tmp = self.path.with_name(f".{LOCK_FILE}.{self.owner['token']}.tmp")
        try:
            with open(tmp, "w") as handle:
                handle.write(json.dumps(self.owner) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException:  # a full disk: no half-written temporary file left behind in the run directory
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _alive(self, holder: dict) -> bool:
        if self.owner["pid_space"] is not None and holder.get("pid_space") == self.owner["pid_space"]:
            pid = int(holder.get("pid", -1))
            return _pid_runs(pid) and holder.get("pid_start") in (None, process_start(pid))
        logger.info("%s is held by %s; watching its heartbeat for up to %.0f s to tell whether it is alive",
                    self.path, describe_owner(holder), self.stale_after_s)
        deadline = time.monotonic() + self.stale_after_s
        while time.monotonic() < deadline:
            time.sleep(min(1.0, self.stale_after_s / 10))
            now = self._read()
            beat = ("token", "heartbeat")
            if now is None or [now.get(k) for k in beat] != [holder.get(k) for k in beat]:
                return True  # it moved (or was released: then the next attempt takes it)
        return False

    def _take_over(self, stale: dict) -> None:
        """Remove the stale lock ``stale`` if it is still the one there (another newcomer may have been quicker)."""
        guard = self.path.with_name(LOCK_FILE + ".takeover")
        try:
            guard.mkdir()
        except FileExistsError:
            if time.time() - guard.stat().st_mtime > TAKEOVER_STALE_S:
                guard.rmdir()
            return
        try:
            current = self._read()
            if current is not None and current.get("token") == stale.get("token"):
                self.path.unlink()
        finally:
            guard.rmdir()

    # ------------------------------------------------------------------------------------------ holding it

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            holder = self._read()
            if holder is None or holder.get("token") != self.owner["token"]:
                logger.error("%s is no longer this process's lock (now: %s): another process may write into the "
                             "run directory", self.path, describe_owner(holder) if holder else "none")
                return
            self.owner["heartbeat"] += 1
            try:
                os.replace(self._write_tmp(), self.path)
            except OSError as error:  # a full disk or a filesystem hiccup: the next beat tries again
                logger.warning("%s: could not renew the lock's heartbeat: %s", self.path, error)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            holder = self._read()
            if holder is not None and holder.get("token") == self.owner["token"]:
                self.path.unlink(missing_ok=True)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
