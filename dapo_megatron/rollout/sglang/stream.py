"""Streamed requests on the SGLang engine's servers (the streaming half of the :class:`RolloutEngine` API).

Each request is one ``/generate`` call (its ``n`` samples as prompt copies with one rid each,
:func:`~dapo_megatron.rollout.sglang.requests.build_stream_payload`) sent by a thread of a pool of at most
``max_concurrent_requests``, to the least-loaded server. Requests beyond that wait here, not on a server.

* Abort: flagged in the :class:`RequestBook`; a request still waiting here never starts, a running one gets
  ``POST /abort_request`` for each of its rids on the server it runs on, which returns it at once with the tokens
  generated so far (``finish_reason`` "abort") — the server keeps nothing of it.
* Weight updates: :meth:`SGLangEngine.update_weights` pauses the servers with ``mode="retract"`` — running requests
  go back to the server's waiting queue and their KV cache is freed — pushes the weights and continues; the
  requests then resume, their prompt and tokens so far re-prefilled by the new weights. The server records the
  version change on every live request, and the reply's ``meta_info.weight_versions`` gives each token's version.
* Failures: a server that stops answering is restarted or taken out of rotation by the pool
  (:meth:`ServerPool.recover`), and the request is re-sent from its prompt; when no server is left, the error
  reaches the caller's next :meth:`poll`.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, Iterable, Sequence

from dapo_megatron.rollout.engine import FinishedRequest, GenerationRequest, Sample
from dapo_megatron.rollout.request_book import RequestBook, aborted_samples
from dapo_megatron.rollout.sglang.client import ServerFailure
from dapo_megatron.rollout.sglang.pool import FailureHandler, ServerPool, ServerSlot
from dapo_megatron.rollout.sglang.reply_workers import ReplyWorkers, generate_samples
from dapo_megatron.rollout.sglang.requests import build_stream_payload, sample_rid, streamed_samples

logger = logging.getLogger(__name__)


class SGLangStreams:
    """The streamed requests of one engine on its ``pool``: ``served_version()`` is the engine's weight version (what
    a request aborted before its first token reports), ``on_failure`` its failover (:meth:`ServerPool.send`);
    ``reply_workers``: the processes that post and parse (None: the thread sending a request does)."""

    def __init__(self, pool: ServerPool, *, max_concurrent_requests: int, served_version: Callable[[], int],
                 on_failure: FailureHandler, reply_workers: ReplyWorkers | None = None,
                 routed_experts: bool = False) -> None:
        self.pool = pool
        self.reply_workers = reply_workers
        self.served_version = served_version
        self.on_failure = on_failure
        self.book = RequestBook("SGLangEngine")
        self._workers = ThreadPoolExecutor(max_workers=max_concurrent_requests, thread_name_prefix="sglang-stream")
        self._lock = threading.Lock()
        self._running_on: dict[str, tuple[ServerSlot, GenerationRequest]] = {}
        self.routed_experts = routed_experts  # R3: every request asks for its routing (requests.py)

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        self.book.add(requests)
        for request in requests:
            self._workers.submit(self._run, request.request_id)

    def poll(self, timeout_s: float) -> list[FinishedRequest]:
        return self.book.poll(timeout_s)

    def abort(self, request_ids: Iterable[str]) -> None:
        self._abort_on_servers(self.book.abort(request_ids, self.served_version()))

    @property
    def num_in_flight(self) -> int:
        return self.book.num_in_flight

    def close(self) -> None:
        self._abort_on_servers(self.book.close(self.served_version()))
        self._workers.shutdown(wait=False, cancel_futures=True)

    def _abort_on_servers(self, running_ids: list[str]) -> None:
        for request_id in running_ids:
            with self._lock:
                slot, request = self._running_on.get(request_id, (None, None))
            if slot is None:
                continue  # not sent yet: _generate_on sees the flag before sending
            for j in range(request.params.n):
                try:
                    slot.client.abort_request(sample_rid(request_id, j))
                except Exception as error:  # noqa: BLE001 - a dead server frees the request anyway
                    logger.warning("aborting %s on %s failed: %s", request_id, slot.client.base_url, error)

    def _run(self, request_id: str) -> None:
        request = self.book.take(request_id)
        if request is None:
            return  # aborted while it waited here
        try:
            payload = build_stream_payload(request, seeded=request.params.seed is not None and self.pool.deterministic,
                                           routed_experts=self.routed_experts)
            samples = self.pool.send(lambda slot: self._generate_on(slot, request, payload), self.on_failure)
        except BaseException as error:  # noqa: BLE001 - the caller's next poll() raises it
            self.book.fail(error)
            return
        self.book.finish(request_id, samples)

    def _generate_on(self, slot: ServerSlot, request: GenerationRequest, payload: dict) -> list[Sample]:
        """One attempt on ``slot``; a failure is the pool's to recover from, and the request is then sent again from
        its prompt."""
        with self._lock:
            self._running_on[request.request_id] = (slot, request)
        try:
            if self.book.is_aborted(request.request_id):  # aborted before it reached a server
                return aborted_samples(request, self.served_version())
            try:
                return generate_samples(self.reply_workers, slot.client, payload,
                                        partial(streamed_samples, request=request, server=slot.client.base_url,
                                                routed_experts=self.routed_experts))
            except ServerFailure:
                if self.book.closed:  # the engine is shutting down and stopped the server: nothing to recover
                    return aborted_samples(request, self.served_version())
                raise
        finally:
            with self._lock:
                self._running_on.pop(request.request_id, None)
