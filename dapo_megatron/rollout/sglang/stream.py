"""Streamed requests on the SGLang engine's servers (the streaming half of the :class:`RolloutEngine` API).

Each request is one ``/generate`` call (its ``n`` samples as prompt copies with one rid each,
:func:`~dapo_megatron.rollout.sglang.requests.build_stream_payload`) sent by a thread of its own to the least-loaded
server once its samples fit the engine's in-flight budget (:class:`~dapo_megatron.rollout.sglang.in_flight.
SampleBudget`, counted in samples: a multi-turn turn of one sample takes one). Requests beyond it wait here, in order,
without a thread, and not on a server.

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
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from typing import Callable, Iterable, Sequence

from dapo_megatron.rollout.engine import FinishedRequest, GenerationRequest, Sample
from dapo_megatron.rollout.request_book import RequestBook, aborted_samples
from dapo_megatron.rollout.sglang.client import ServerFailure
from dapo_megatron.rollout.sglang.in_flight import SampleBudget
from dapo_megatron.rollout.sglang.lora_adapters import ServedAdapters
from dapo_megatron.rollout.sglang.pool import FailureHandler, ServerPool, ServerSlot
from dapo_megatron.rollout.sglang.reply_workers import ReplyWorkers, generate_samples
from dapo_megatron.rollout.sglang.requests import build_stream_payload, sample_rid, streamed_samples

logger = logging.getLogger(__name__)


class SGLangStreams:
    """The streamed requests of one engine on its ``pool``: ``served_version()`` is the engine's weight version (what
    a request aborted before its first token reports), ``on_failure`` its failover (:meth:`ServerPool.send`);
    ``reply_workers``: the processes that post and parse (None: the thread sending a request does)."""

    def __init__(self, pool: ServerPool, *, in_flight: SampleBudget, served_version: Callable[[], int],
                 on_failure: FailureHandler, reply_workers: ReplyWorkers | None = None,
                 adapters: ServedAdapters | None = None) -> None:
        self.pool = pool
        self.in_flight = in_flight
        self.reply_workers = reply_workers
        self.served_version = served_version
        self.on_failure = on_failure
        self.book = RequestBook("SGLangEngine")
        # a request gets a thread once its samples are taken, and holds at least one: `limit` threads are enough
        self._workers = ThreadPoolExecutor(max_workers=in_flight.limit, thread_name_prefix="sglang-stream")
        self._waiting: deque[GenerationRequest] = deque()  # submitted, their samples not taken yet
        self._closed = False
        self._lock = threading.Lock()
        in_flight.when_room(self._admit)  # samples given back by anyone (batch generation too)
        self._running_on: dict[str, tuple[ServerSlot, GenerationRequest]] = {}
        self.routed_topk: int | None = None  # R3: the model's top-k; every request asks for its routing (requests.py)
        self.adapters = adapters  # LoRA: the adapter each request names (lora_adapters.py)

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        self.book.add(requests)
        with self._lock:
            self._waiting.extend(requests)
        self._admit()

    def _admit(self) -> None:
        """Hand waiting requests to threads, in order, while their samples fit."""
        while True:
            with self._lock:
                if self._closed or not self._waiting or not self.in_flight.try_take(self._waiting[0].params.n):
                    return
                request = self._waiting.popleft()
            self._workers.submit(self._run, request.request_id, request.params.n)

    def poll(self, timeout_s: float) -> list[FinishedRequest]:
        return self.book.poll(timeout_s)

    def abort(self, request_ids: Iterable[str]) -> None:
        self._abort_on_servers(self.book.abort(request_ids, self.served_version()))

    @property
    def num_in_flight(self) -> int:
        return self.book.num_in_flight

    def close(self) -> None:
        with self._lock:
            self._closed = True  # nothing waiting here starts any more
            self._waiting.clear()
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

    def _run(self, request_id: str, samples_taken: int) -> None:
        try:
            self._send(request_id)
        finally:
            self.in_flight.give_back(samples_taken)  # admits who waits (when_room)

    def _send(self, request_id: str) -> None:
        request = self.book.take(request_id)
        if request is None:
            return  # aborted while it waited here
        try:
            with self._adapter() as (adapter, adapter_version):
                payload = build_stream_payload(request, routed_experts=self.routed_topk is not None, adapter=adapter,
                                               seeded=request.params.seed is not None and self.pool.deterministic)
                samples = self.pool.send(lambda slot: self._generate_on(slot, request, payload, adapter_version),
                                         self.on_failure)
        except BaseException as error:  # noqa: BLE001 - the caller's next poll() raises it
            self.book.fail(error)
            return
        self.book.finish(request_id, samples)

    def _adapter(self):
        """The LoRA adapter a request names, counted in flight while it runs (no adapter: ``({}, None)``)."""
        return self.adapters.request() if self.adapters is not None else nullcontext(({}, None))

    def _generate_on(self, slot: ServerSlot, request: GenerationRequest, payload: dict,
                     adapter_version: int | None = None) -> list[Sample]:
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
                                                routed_topk=self.routed_topk, adapter_version=adapter_version))
            except ServerFailure:
                if self.book.closed:  # the engine is shutting down and stopped the server: nothing to recover
                    return aborted_samples(request, self.served_version())
                raise
        finally:
            with self._lock:
                self._running_on.pop(request.request_id, None)
