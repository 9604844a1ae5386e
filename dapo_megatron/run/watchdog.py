"""A trainer rank that stops — SIGSTOP, a wedged driver, a lost node — ends the job within
``parallel.collective_timeout_s``, and the line that ends it names the rank and what it was doing.

Why the project needs one of its own (issue 42): on the CPU path nothing else notices. torchrun and srun watch their
workers for exits, and a stopped process never exits; megatron made its TP/PP/DP/EP groups with a 30-minute timeout
of its own (now :func:`dapo_megatron.platform.init_distributed` passes ours); and while rank 0 generates, the other
ranks wait for it in rank_zero's gloo group, whose timeout is a week because a rollout may legitimately take hours
(rank 0's own broadcast of the batch waits there for its receivers too). On GPUs NCCL's watchdog bounds a hung
collective, but not a rank that stopped between collectives nor the wait for rank 0. So:

* every rank runs a thread that, every ``timeout / 10`` seconds (at most 10 s) and whenever the rank enters a stage,
  writes a heartbeat — a counter, the step and stage it is in (:class:`RankActivity`), its host and pid — into the
  job's rendezvous store (torchrun's agent's TCPStore, or the one rank 0 hosts under srun or a plain launch: the
  store the process group was made with), and reads every other rank's; a second thread judges, so that a store
  call left hanging by a stopped store host does not stop the clock;
* a rank whose counter has not moved for the timeout, measured on the reader's own clock (nodes' clocks need not
  agree), has stopped; so has the store's host when the store does not answer for that long. The reader then appends
  a row to ``<run_dir>/faults.jsonl``, prints one line naming the rank, its host and pid, its step and stage and how
  long it has been silent, SIGKILLs the silent rank when it can see its pid (same kernel and PID namespace, the same
  process start time: a stopped process cannot act on the SIGTERM the launcher's teardown sends first, and torchrun
  would wait 30 s for it), and ends its own process with :data:`WATCHDOG_EXIT_CODE` — torchrun then stops the other
  workers (and restarts them all under ``--max-restarts``), srun's ``--kill-on-bad-exit`` ends the step;
* a rank that leaves (its run ended, or it failed and its launcher takes over) says so first: it is not waited for.

A thread keeps beating while its main thread computes, waits in a collective or compiles (none holds the GIL for
long), so the timeout is the bound on silence, not on a stage: a slow stage is the collectives' business
(``parallel.slow_collective_timeout_s``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

from dapo_megatron.launch_env import launch_env
from dapo_megatron.run.lock import pid_space, process_start

logger = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 69  # sysexits' EX_UNAVAILABLE: a rank of the job, or the job's store, stopped answering
FAULTS_FILE = "faults.jsonl"
KEY_PREFIX = "dapo_watchdog"
STOP_WAIT_S = 5.0  # how long leaving waits for the last heartbeat to reach the store
MIN_BEAT_GAP_S = 0.1  # stage changes come faster than that on a tiny CPU model: a beat carries the latest
# What a rank does, as its heartbeat and its errors name it (the trainer's stages: dapo_megatron/trainer/loop.py).
STAGES = ("startup", "resume", "rollout", "pi_old", "update", "handoff", "validation", "checkpoint", "metrics",
          "shutdown")


class RankActivity:
    """The step and stage this rank is in. :meth:`in_stage` sets them for a block; an exception leaving the block gets a
    note naming them (the innermost block's: where it happened), which the traceback and the one-line error show."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.step = 0
        self.stage = "startup"
        self.changed = threading.Event()  # wakes the heartbeat: a stage change is sent at once

    @contextlib.contextmanager
    def in_stage(self, stage: str, step: int | None = None) -> Iterator[None]:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; known: {STAGES}")
        saved = (self.step, self.stage)
        self.enter(stage, self.step if step is None else step)
        try:
            yield
        except BaseException as error:
            if not getattr(error, "dapo_where", None):
                error.dapo_where = self.where()
                error.add_note(error.dapo_where)
            raise
        finally:
            self.enter(saved[1], saved[0])

    def enter(self, stage: str, step: int) -> None:
        """Set the stage and step (without a block: e.g. the updates once π_old is done)."""
        self.stage, self.step = stage, step
        self.changed.set()

    def where(self) -> str:
        return f"on rank {self.rank} at step {self.step}, stage {self.stage}"


@dataclass
class Heartbeat:
    """One rank's record in the store, rewritten every interval."""

    beat: int
    step: int
    stage: str
    host: str
    pid: int
    pid_space: str | None  # which pids the rank's host sees (lock.py's boot id + PID namespace)
    started: str | None  # the pid's start time: a reused pid is not the rank
    left: bool = False  # the rank's run is over (normally or not): its silence is no fault

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Heartbeat":
        return cls(**json.loads(raw))


@dataclass
class Silence:
    """A rank (or the store) not heard from for longer than the timeout."""

    rank: int | None  # None: the store itself did not answer
    seconds: float
    last: Heartbeat | None  # what the rank last said (None: never heard from)
    store: str  # host:port of the store, for the message

    def line(self, timeout_s: float, detected_by: int) -> str:
        limit = f"(parallel.collective_timeout_s={timeout_s:g})"
        if self.rank is None:
            who = f"the job's rendezvous store at {self.store} (hosted by torchrun's agent, or by rank 0's process)"
        else:
            where = f" ({self.last.host}, pid {self.last.pid})" if self.last else ""
            who = f"rank {self.rank}{where}"
        doing = (f"; it was at step {self.last.step}, stage {self.last.stage}" if self.last and self.rank is not None
                 else "; it never sent a heartbeat" if self.rank is not None else "")
        return (f"watchdog: {who} has not been heard from for {self.seconds:.0f} s {limit}{doing}; rank {detected_by} "
                f"ends the job (exit {WATCHDOG_EXIT_CODE})")


def heartbeat_interval(timeout_s: float) -> float:
    """A tenth of the timeout, between 0.5 and 10 s: ten missed beats before a rank counts as stopped."""
    return min(max(timeout_s / 10, 0.5), 10.0)


def collective_limit(timeout_s: float, *, watched: bool) -> float:
    """The process groups' timeout for a bound of ``timeout_s``: with the watchdog on, two heartbeats and 5 s longer,
    so that a rank that stopped is named (and killed) by the watchdog rather than reported by gloo or NCCL as a bare
    timeout on the ranks that waited for it (the same instant otherwise: measured, the gloo timeout won)."""
    return timeout_s + 2 * heartbeat_interval(timeout_s) + 5.0 if watched else timeout_s


class Watchdog:
    """The heartbeat thread of one rank (see the module docstring). ``store`` is a ``torch.distributed.Store`` of its
    own (a client of the job's TCPStore); ``on_silence`` runs once in the thread when a peer or the store went silent
    (default :meth:`end_job`); ``namespace`` keeps restarts of a job apart in a store that outlives them (torchrun's
    agent's)."""

    def __init__(self, activity: RankActivity, *, store, rank: int, world_size: int, timeout_s: float,
                 run_dir: str | Path | None, store_address: str = "", namespace: str = "0",
                 on_silence: Callable[[Silence], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.activity = activity
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.timeout_s = timeout_s
        self.interval_s = heartbeat_interval(timeout_s)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.store_address = store_address
        self.on_silence = on_silence or self.end_job
        self._clock = clock
        self._prefix = f"{KEY_PREFIX}/{namespace}"
        self._beat = 0
        self._me = Heartbeat(0, 0, "startup", socket.gethostname(), os.getpid(), pid_space(),
                             process_start(os.getpid()))
        self._seen: dict[int, tuple[bytes | None, float]] = {}  # rank -> (its last record, when it last changed)
        self._answered_at = clock()  # when the store last answered a whole round
        self._found: Silence | None = None  # a silent rank the heartbeat thread saw, for the judging thread
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None
        self._judging: threading.Thread | None = None
        self.fired: Silence | None = None

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    # ------------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> "Watchdog":
        started = self._clock()
        self._seen = {rank: (None, started) for rank in range(self.world_size) if rank != self.rank}
        self._answered_at = started
        self._beating = threading.Thread(target=self._beat_loop, name="dapo-watchdog-heartbeat", daemon=True)
        self._judging = threading.Thread(target=self._judge_loop, name="dapo-watchdog", daemon=True)
        self._beating.start()
        self._judging.start()
        return self

    def stop(self) -> None:
        """Leave: the heartbeat thread's last word tells the other ranks not to wait for this one. Bounded: a store
        that does not answer (its host stopped) is given up on."""
        self._stop.set()
        self.activity.changed.set()
        for thread in (self._judging, self._beating):
            if thread is not None:
                thread.join(self.interval_s + STOP_WAIT_S)
        self._judging = self._beating = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _beat_loop(self) -> None:
        """Store traffic, in a thread of its own: a TCPStore whose host stopped leaves a call hanging past its
        timeout, and the judging thread must still see the time pass."""
        while not self._stop.is_set():
            self.activity.changed.clear()
            try:
                silence = self.check()
            except Exception:  # noqa: BLE001 - the store refused or timed out: _answered_at stays where it was
                silence = None
            else:
                self._answered_at = self._clock()
            if silence is not None:
                self._found = silence
            self.activity.changed.wait(self.interval_s)  # the next beat, or a new stage to tell
            self._stop.wait(MIN_BEAT_GAP_S)
        with contextlib.suppress(Exception):  # the store may be gone with rank 0 already: nothing left to tell
            self._me.left = True
            self.store.set(self._key(self.rank), self._me.encode())

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.interval_s / 2):
            silence = self._found
            quiet = self._clock() - self._answered_at
            if silence is None and quiet > self.timeout_s:
                silence = Silence(None, quiet, None, self.store_address)
            if silence is not None and not self._stop.is_set():
                self.fired = silence
                self.on_silence(silence)
                return

    # ------------------------------------------------------------------------------------------------ one round

    def check(self) -> Silence | None:
        """Send this rank's heartbeat and read the others' (raises what the store raises); the first rank silent for
        longer than the timeout, else None."""
        self._beat += 1
        self._me.beat, self._me.step, self._me.stage = self._beat, self.activity.step, self.activity.stage
        self.store.set(self._key(self.rank), self._me.encode())
        records = self._read_all()
        now = self._clock()
        for rank, record in records.items():
            previous, changed_at = self._seen[rank]
            if record != previous:
                self._seen[rank] = (record, now)
                continue
            last = Heartbeat.decode(record) if record is not None else None
            if last is not None and last.left:
                continue
            if now - changed_at > self.timeout_s:
                return Silence(rank, now - changed_at, last, self.store_address)
        return None

    def _read_all(self) -> dict[int, bytes | None]:
        """Every other rank's record: two store calls once all have one (a store serves every rank of a big job)."""
        ranks = list(self._seen)
        keys = [self._key(rank) for rank in ranks]
        if self.store.check(keys):
            return dict(zip(ranks, self.store.multi_get(keys)))
        return {rank: self._read(rank) for rank in ranks}

    def _read(self, rank: int) -> bytes | None:
        key = self._key(rank)
        return self.store.get(key) if self.store.check([key]) else None

    # ------------------------------------------------------------------------------------------------ the end

    def end_job(self, silence: Silence) -> None:
        """Record and say who stopped, kill it if this host can, and end this process (see the module docstring)."""
        threading.Timer(10.0, os._exit, args=(WATCHDOG_EXIT_CODE,)).start()  # a blocked stderr must not keep us
        line = silence.line(self.timeout_s, self.rank)
        self.record(silence, line)
        kill_if_visible(silence.last)
        with contextlib.suppress(Exception):
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        os._exit(WATCHDOG_EXIT_CODE)

    def record(self, silence: Silence, line: str) -> None:
        """One row of ``<run_dir>/faults.jsonl`` (what the restarts and bench/chaos.py read)."""
        if self.run_dir is None:
            return
        last = silence.last
        row = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
               "kind": "store silent" if silence.rank is None else "rank silent", "rank": silence.rank,
               "step": last.step if last else None, "stage": last.stage if last else None,
               "silent_s": round(silence.seconds, 1), "timeout_s": self.timeout_s, "detected_by": self.rank,
               "line": line}
        with contextlib.suppress(OSError):
            with open(self.run_dir / FAULTS_FILE, "a") as file:
                file.write(json.dumps(row) + "\n")


def kill_if_visible(last: Heartbeat | None) -> bool:
    """SIGKILL the rank that said ``last`` when its pid is this kernel's and PID namespace's and still names the same
    process; True when signalled."""
    if last is None or last.pid_space is None or last.pid_space != pid_space():
        return False
    if last.started is None or process_start(last.pid) != last.started:
        return False
    try:
        os.kill(last.pid, signal.SIGKILL)
    except OSError:
        return False
    return True


def job_watchdog(activity: RankActivity, *, timeout_s: float, run_dir: str | Path | None,
                 environ=None) -> Watchdog | None:
    """The watchdog of this process in its launch (not started), on a client of the job's rendezvous store; None in a
    world of one (nobody to watch)."""
    from torch.distributed import TCPStore  # the CLI reads this module's exit code without torch

    env = launch_env(environ)
    if env.world_size == 1:
        return None
    store = TCPStore(env.master_addr, env.master_port, is_master=False, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    return Watchdog(activity, store=store, rank=env.rank, world_size=env.world_size, timeout_s=timeout_s,
                    run_dir=run_dir, store_address=f"{env.master_addr}:{env.master_port}",
                    namespace=str(env.restart_count))
