"""Worker processes that run your reward function with a timeout per call, so that a slow, hanging or crashing
reward never stalls generation or training.

:meth:`RewardPool.run` hands calls to idle workers (an ``async def`` reward: up to ``async_concurrency`` calls per
worker) and waits for the answers. A plain function's call past ``timeout_s`` is ended by killing its worker (a hung
call cannot be interrupted any other way), an async one's by ``asyncio.wait_for`` inside the worker (its worker is
killed only when its event loop stops answering ``ASYNC_GRACE_S`` later); either way the call's responses come back
as ``timeout`` and a new worker takes the killed one's place while the others go on. A worker that dies
(``os._exit``, a segfault, a kill) fails its calls as ``error``; one that died between calls is found when a call is
sent to it, and the call goes to its replacement. Processes are started with ``spawn`` (the trainer has
threads: forking it is unsafe), and a worker ends when the trainer does (its pipe closes).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from dapo_megatron.reward.function import (
    Outcome,
    RewardForm,
    RewardFunctionError,
    load_reward_function,
    reward_form,
)
from dapo_megatron.reward.worker import call_size, serve

logger = logging.getLogger(__name__)

ASYNC_GRACE_S = 5.0  # an async worker's own timeout answers first; this much later its process is killed
START_TIMEOUT_S = 300.0  # a worker importing your module for longer than this is an error
STOP_TIMEOUT_S = 5.0


@dataclass
class _Worker:
    process: multiprocessing.Process
    conn: Connection
    started: float
    ready: bool = False
    calls: dict[int, float] = field(default_factory=dict)  # call id → deadline (monotonic)


class RewardPool:
    """``num_workers`` processes running ``target`` (see the module docstring). ``run`` may be called from any
    thread, one call at a time (a lock serializes it)."""

    def __init__(self, target: str, *, num_workers: int, timeout_s: float, async_concurrency: int = 1):
        self.target = target
        self.form: RewardForm = reward_form(load_reward_function(target), target)  # fails here, in the trainer
        self.timeout_s = timeout_s
        self._capacity = async_concurrency if self.form.is_async else 1
        self._limit_s = timeout_s + (ASYNC_GRACE_S if self.form.is_async else 0.0)
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self.restarts = 0
        self._workers = [self._start_worker() for _ in range(num_workers)]
        try:
            self._wait_until_ready()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------------ workers

    def _start_worker(self) -> _Worker:
        parent_end, child_end = self._context.Pipe(duplex=True)
        process = self._context.Process(target=serve, args=(child_end, self.target, self.timeout_s),
                                        name="dapo-reward-worker", daemon=True)
        process.start()
        child_end.close()
        return _Worker(process, parent_end, time.monotonic())

    def _wait_until_ready(self) -> None:
        while not all(w.ready for w in self._workers):
            self._check_start_times()
            for conn in wait([w.conn for w in self._workers if not w.ready], timeout=1.0):
                self._receive(self._worker_of(conn), results=None)

    def _check_start_times(self) -> None:
        now = time.monotonic()
        for worker in self._workers:
            if not worker.ready and now - worker.started > START_TIMEOUT_S:
                raise RewardFunctionError(f"{self.target!r}: a reward worker did not finish importing it within "
                                          f"{START_TIMEOUT_S:.0f} s")

    def _worker_of(self, conn: Connection) -> _Worker:
        return next(w for w in self._workers if w.conn is conn)

    def _replace(self, worker: _Worker) -> None:
        """Kill ``worker`` (if it still runs) and start another in its place; its calls are the caller's to settle."""
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join()
        worker.conn.close()
        self._workers[self._workers.index(worker)] = self._start_worker()
        self.restarts += 1

    # ------------------------------------------------------------------------------------------------ calls

    def run(self, calls: list[dict]) -> list[list[Outcome]]:
        """The outcomes of ``calls`` (keyword arguments of your function), one list per call with one
        ``(status, RewardValue | message)`` per response, in the order of ``calls``."""
        with self._lock:
            results: list[list[Outcome] | None] = [None] * len(calls)
            pending = deque(range(len(calls)))
            while pending or any(w.calls for w in self._workers):
                self._dispatch(calls, pending, results)
                self._expire(calls, results, pending)
                self._check_start_times()
                deadlines = [d for w in self._workers for d in w.calls.values()]
                timeout = max(min(deadlines) - time.monotonic(), 0.0) if deadlines else 1.0
                waitables = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
                for ready in wait(waitables, timeout=timeout):
                    worker = next((w for w in self._workers if ready in (w.conn, w.process.sentinel)), None)
                    if worker is not None:  # None: replaced while handling an earlier item of this list
                        self._receive(worker, results, calls)
            return results

    def _dispatch(self, calls: list[dict], pending: deque, results: list) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            while worker.ready and pending and len(worker.calls) < self._capacity:
                call_id = pending.popleft()
                try:
                    worker.conn.send((call_id, calls[call_id]))
                except OSError:  # it died between calls (killed, out of memory): the call goes to another worker
                    pending.appendleft(call_id)
                    self._died(worker, results, calls)
                    break
                worker.calls[call_id] = now + self._limit_s

    def _expire(self, calls: list[dict], results: list, pending: deque) -> None:
        """Kill each worker holding a call past its deadline: those calls time out, its others go back in line."""
        now = time.monotonic()
        for worker in list(self._workers):
            expired = [c for c, deadline in worker.calls.items() if deadline <= now]
            if not expired:
                continue
            for call_id in worker.calls:
                if call_id in expired:
                    message = f"no answer within reward.timeout_s={self.timeout_s:g} s (the worker was restarted)"
                    results[call_id] = [("timeout", message)] * call_size(calls[call_id], self.form)
                else:
                    pending.appendleft(call_id)
            self._replace(worker)

    def _receive(self, worker: _Worker, results: list | None, calls: list[dict] | None = None) -> None:
        """Read what ``worker`` says, or settle its calls if it died."""
        try:
            message = worker.conn.recv() if worker.conn.poll() else None
        except (EOFError, OSError):
            message = None
        if message is None:
            if worker.process.is_alive():
                return  # its sentinel was not what woke us: nothing to read yet
            self._died(worker, results, calls)
            return
        tag, payload = message  # tag: "ready", "load_error", or the id of the call answered
        if tag == "ready":
            worker.ready = True
        elif tag == "load_error":
            raise RewardFunctionError(payload)
        else:
            worker.calls.pop(tag, None)
            results[tag] = payload

    def _died(self, worker: _Worker, results: list | None, calls: list[dict] | None) -> None:
        worker.process.join(STOP_TIMEOUT_S)  # a closed pipe of a process still running: _replace kills it
        code = worker.process.exitcode
        if not worker.ready:
            raise RewardFunctionError(f"{self.target!r}: a reward worker exited (code {code}) while importing it")
        for call_id in worker.calls:
            message = f"the reward worker process died (exit code {code})"
            results[call_id] = [("error", message)] * call_size(calls[call_id], self.form)
        worker.calls.clear()
        self._replace(worker)

    def close(self) -> None:
        """Stop the workers (a hung one is killed)."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in self._workers:
            worker.process.join(max(deadline - time.monotonic(), 0.0))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        self._workers = []
