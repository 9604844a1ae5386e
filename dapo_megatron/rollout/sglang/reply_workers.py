"""``/generate`` calls and their reply parsing in worker processes of their own (``rollout.sglang.reply_processes``).

A streamed request's reply is a multi-MB JSON document (per token: an id, a log-prob, a version span). Parsed in a
thread of trainer rank 0, ``json.loads`` and the per-token lists hold the GIL while rank 0 launches its TP/PP
kernels, so every other rank waits on it. With ``reply_processes: N > 0`` the engine hands each call to one of N
spawned processes instead: a process runs a few threads, each posting one payload with its own
:class:`~dapo_megatron.rollout.sglang.client.SGLangClient` and parsing the reply with the same function rank 0 would
have used (``parse``). The samples come back as numpy arrays (a pickle of a few buffers, not of a list of
Python numbers) and are turned into :class:`Sample` lists at rank 0 with ``ndarray.tolist`` (C speed): consumers
(:mod:`dapo_megatron.collectors.group`) take lists, and a ``Sample`` keeps exactly what the in-process path
gives (ids as int64, log-probs as float64: bit-equal).

Errors raised in a worker (:class:`ServerFailure`, :class:`ServerReplyError`, :class:`RolloutError`) come back as
the same type with the same message, so the pool's failover (:meth:`ServerPool.send`) treats them as it treats an
in-process call. A worker process that dies fails every call in flight with :class:`RolloutError` and the pool
refuses new ones (which worker held which call is not known). :meth:`ReplyWorkers.close` stops and joins every
process; a worker whose parent disappears (killed with SIGKILL) exits by itself.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import numpy as np
import torch

from dapo_megatron.rollout.engine import RolloutError, Sample
from dapo_megatron.rollout.sglang.client import SGLangClient

logger = logging.getLogger(__name__)

ReplyParser = Callable[[list[dict[str, Any]]], list[Sample]]  # picklable: a module-level function or a partial of one

_READY_TIMEOUT_S = 120.0  # a spawned worker imports torch (via the rollout package) before it says it is ready
_JOIN_TIMEOUT_S = 30.0  # a worker asked to stop exits at once; on a loaded 2-core machine that took over 5 s
_TASK_POLL_S = 1.0


class ReplyWorkers:
    """``num_processes`` spawned processes of ``threads_per_process`` threads each, posting ``/generate`` payloads
    as the :class:`SGLangClient` a call names would (its URL, API key and timeout).

    Tasks go out on one shared queue; each process answers on a pipe of its own and is stopped by closing another.
    A worker's death shows as the end of its reply pipe and breaks the pool, so nothing here waits on a lock or an
    event a killed worker may have held (the task queue's included)."""

    def __init__(self, num_processes: int, *, threads_per_process: int) -> None:
        if num_processes < 1 or threads_per_process < 1:
            raise ValueError(f"ReplyWorkers: need >= 1 process and thread, got {num_processes} x "
                             f"{threads_per_process}")
        context = multiprocessing.get_context("spawn")  # never fork a trainer holding CUDA contexts and threads
        self._tasks = context.Queue()
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._broken: str | None = None
        self._closed = False
        self._receiver: threading.Thread | None = None
        self.threads_per_process = threads_per_process
        self.processes = []
        self._replies: dict[Connection, str] = {}  # a worker's reply pipe -> its name
        self._stops: list[Connection] = []
        try:
            for index in range(num_processes):
                reply_reader, reply_writer = context.Pipe(duplex=False)
                stop_reader, stop_writer = context.Pipe(duplex=False)
                process = context.Process(target=_serve, name=f"sglang-reply-{index}", daemon=True,
                                          args=(self._tasks, reply_writer, stop_reader, threads_per_process))
                process.start()
                reply_writer.close()  # the worker holds the only writer: its end is the pipe's end
                stop_reader.close()
                self.processes.append(process)
                self._replies[reply_reader] = process.name
                self._stops.append(stop_writer)
            self._await_ready()
        except BaseException:
            self.close()
            raise
        self._receiver = threading.Thread(target=self._receive, name="sglang-reply-receiver", daemon=True)
        self._receiver.start()

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def _exitcode(self, name: str) -> int | None:
        return next((process.exitcode for process in self.processes if process.name == name), None)

    def _await_ready(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for reader, name in self._replies.items():
            try:
                if reader.poll(max(0.0, deadline - time.monotonic())) and reader.recv() == "ready":
                    continue
            except EOFError:
                pass
            raise RolloutError(f"SGLang reply worker {name} did not start within {_READY_TIMEOUT_S:.0f} s (exit "
                               f"code {self._exitcode(name)}; None: still running)")

    def submit(self, client: SGLangClient, payload: dict[str, Any], parse: ReplyParser) -> Future:
        """``client.generate(payload)`` in a worker, its outputs parsed there with ``parse``; the future gives the
        samples or raises what the call raised."""
        future: Future = Future()
        with self._lock:
            if self._closed or self._broken:
                raise RolloutError(f"SGLang reply workers are {'closed' if self._closed else self._broken}")
            task_id = next(self._ids)
            self._pending[task_id] = future
        self._tasks.put((task_id, (client.base_url, client.api_key, client.timeout_s), payload, parse))
        return future

    def generate(self, client: SGLangClient, payload: dict[str, Any], parse: ReplyParser) -> list[Sample]:
        """:meth:`submit` and wait; the worker's HTTP timeout bounds the wait, a dead worker ends it."""
        return self.submit(client, payload, parse).result()

    def _receive(self) -> None:
        readers = dict(self._replies)
        while readers:
            for reader in wait(list(readers)):
                try:
                    task_id, ok, value = reader.recv()
                except (EOFError, OSError):  # the worker exited: asked to by close(), or it died
                    self._lost(readers.pop(reader))
                    continue
                with self._lock:
                    future = self._pending.pop(task_id, None)
                if future is None:
                    continue
                if ok:
                    future.set_result([_sample(fields) for fields in value])
                else:
                    future.set_exception(pickle.loads(value))

    def _lost(self, name: str) -> None:
        """A worker's pipe ended. Which calls it held is not known, so while the pool is open every call in flight
        fails and the pool takes no more."""
        with self._lock:
            if self._closed or self._broken:
                return
            self._broken = f"broken: {name} died (exit code {self._exitcode(name)})"
            pending, self._pending = self._pending, {}
        logger.error("SGLang reply workers %s; failing %d call(s) in flight", self._broken, len(pending))
        for future in pending.values():
            future.set_exception(RolloutError(f"SGLang reply worker {name} died during the call"))

    def close(self) -> None:
        """Stop every worker (calls in flight fail with :class:`RolloutError`) and wait for them to exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, {}
        for stop in self._stops:
            stop.close()  # the worker sees its stop pipe end and exits
        for process in self.processes:
            process.join(_JOIN_TIMEOUT_S)
        for process in self.processes:
            if process.is_alive():  # stuck in interpreter shutdown: nothing it does matters now
                process.kill()
                process.join(_JOIN_TIMEOUT_S)
        for future in pending.values():
            future.set_exception(RolloutError("SGLang reply workers were closed during the call"))
        if self._receiver is not None:
            self._receiver.join(_JOIN_TIMEOUT_S)  # every reply pipe has ended with its worker
        for reader in self._replies:
            reader.close()
        self._tasks.cancel_join_thread()
        self._tasks.close()


def generate_samples(workers: ReplyWorkers | None, client: SGLangClient, payload: dict[str, Any],
                     parse: ReplyParser) -> list[Sample]:
    """``parse(client.generate(payload))``: in one of ``workers`` when there are any, else in this thread."""
    if workers is None:
        return parse(client.generate(payload))
    return workers.generate(client, payload, parse)


def _compact(sample: Sample) -> tuple:
    routing = None if sample.routed_experts is None else sample.routed_experts.numpy()
    return (sample.prompt_index, np.asarray(sample.token_ids, dtype=np.int64),
            np.asarray(sample.logprobs, dtype=np.float64), sample.finish_reason, sample.weight_version,
            np.asarray(sample.token_versions, dtype=np.int64), routing)


def _sample(fields: tuple) -> Sample:
    prompt_index, token_ids, logprobs, finish_reason, weight_version, token_versions, routing = fields
    return Sample(prompt_index=prompt_index, token_ids=token_ids.tolist(), logprobs=logprobs.tolist(),
                  finish_reason=finish_reason, weight_version=weight_version, token_versions=token_versions.tolist(),
                  routed_experts=None if routing is None else torch.from_numpy(routing))


def _portable(error: BaseException) -> bytes:
    """``error`` pickled, or a :class:`RolloutError` naming it when it does not pickle (its traceback stays here)."""
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001 - anything unpicklable still has to reach the caller
        return pickle.dumps(RolloutError(f"{type(error).__name__}: {error}"))


def _serve(tasks, replies: Connection, stop: Connection, threads: int) -> None:
    """A worker process: ``threads`` threads take tasks until ``stop`` ends (closed by :meth:`ReplyWorkers.close`,
    or by the system when the trainer dies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes us
    send_lock = threading.Lock()

    def work() -> None:
        while True:
            try:
                task = tasks.get(timeout=_TASK_POLL_S)
            except queue.Empty:
                continue
            task_id, (base_url, api_key, timeout_s), payload, parse = task
            try:
                client = SGLangClient(base_url, api_key, timeout_s)  # a few attributes: no connection is kept
                reply = (task_id, True, [_compact(sample) for sample in parse(client.generate(payload))])
            except BaseException as error:  # noqa: BLE001 - every failure is the caller's to see
                reply = (task_id, False, _portable(error))
            with send_lock:
                replies.send(reply)

    for index in range(threads):
        threading.Thread(target=work, name=f"reply-{index}", daemon=True).start()
    replies.send("ready")
    stop.poll(None)  # returns when the other end closes; the daemon threads end with the process
