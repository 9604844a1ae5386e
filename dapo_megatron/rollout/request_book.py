"""The streamed requests of one engine, shared by the caller's thread and the engine's background workers.

A request is *queued* (submitted, not started), *running* (a worker decodes it), then *finished* (all samples done
or aborted) until :meth:`RequestBook.poll` hands it back. Aborting a queued request finishes it at once with empty
aborted samples; aborting a running one only flags it — the worker stops it at its next token (and an SGLang engine
also tells the server). A worker that fails records the error, and the next :meth:`RequestBook.poll` raises it:
the caller is never left waiting on work nobody does.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Iterable, Sequence

from dapo_megatron.rollout.engine import FinishedRequest, GenerationRequest, RolloutError, Sample


def aborted_samples(request: GenerationRequest, version: int) -> list[Sample]:
    """The ``n`` samples of a request aborted before it produced a token."""
    return [Sample(prompt_index=0, token_ids=[], logprobs=[], finish_reason="abort", weight_version=version)
            for _ in range(request.params.n)]


class RequestBook:
    def __init__(self, owner: str) -> None:
        self.owner = owner  # named in errors
        self._cond = threading.Condition()
        self._queued: OrderedDict[str, GenerationRequest] = OrderedDict()
        self._running: dict[str, GenerationRequest] = {}
        self._aborted: set[str] = set()
        self._finished: list[FinishedRequest] = []
        self._error: BaseException | None = None
        self._closed = False

    # ---- caller side -------------------------------------------------------------------------------------------
    def add(self, requests: Sequence[GenerationRequest]) -> None:
        with self._cond:
            if self._closed:
                raise RolloutError(f"{self.owner}: submit after shutdown")
            known = set(self._queued) | set(self._running) | {f.request_id for f in self._finished}
            for request in requests:
                if request.request_id in known:
                    raise ValueError(f"{self.owner}.submit: request id {request.request_id!r} is already in flight")
                known.add(request.request_id)
            for request in requests:
                self._queued[request.request_id] = request
            self._cond.notify_all()

    def abort(self, request_ids: Iterable[str], version: int) -> list[str]:
        """Flag the requests; queued ones finish now. Returns the ids of the running ones among them."""
        running = []
        with self._cond:
            for request_id in request_ids:
                if request_id in self._queued:
                    request = self._queued.pop(request_id)
                    self._finished.append(FinishedRequest(request_id, aborted_samples(request, version)))
                elif request_id in self._running:
                    self._aborted.add(request_id)
                    running.append(request_id)
            self._cond.notify_all()
        return running

    def poll(self, timeout_s: float) -> list[FinishedRequest]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._finished and self._error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if self._error is not None:
                raise RolloutError(f"{self.owner} failed in the background: {self._error}") from self._error
            finished, self._finished = self._finished, []
            return finished

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._queued) + len(self._running) + len(self._finished)

    def close(self, version: int) -> list[str]:
        """No more submissions; queued requests finish as aborted; returns the running ids (to abort)."""
        with self._cond:
            self._closed = True
            ids = list(self._queued) + list(self._running)
        return self.abort(ids, version)

    # ---- worker side -------------------------------------------------------------------------------------------
    def take_all_queued(self, timeout_s: float) -> list[GenerationRequest]:
        """Every queued request, now running; waits up to ``timeout_s`` for one (empty when none or closed)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._queued and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            taken = list(self._queued.values())
            self._queued.clear()
            self._running.update((r.request_id, r) for r in taken)
            return taken

    def take(self, request_id: str) -> GenerationRequest | None:
        """This queued request, now running; None if it was aborted (or finished) meanwhile."""
        with self._cond:
            request = self._queued.pop(request_id, None)
            if request is not None:
                self._running[request_id] = request
            return request

    def has_aborted(self) -> bool:
        """Whether any request is flagged aborted and not finished yet."""
        with self._cond:
            return bool(self._aborted)

    def is_aborted(self, request_id: str) -> bool:
        with self._cond:
            return request_id in self._aborted

    def finish(self, request_id: str, samples: list[Sample]) -> None:
        with self._cond:
            self._running.pop(request_id, None)
            self._aborted.discard(request_id)
            self._finished.append(FinishedRequest(request_id, samples))
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed
