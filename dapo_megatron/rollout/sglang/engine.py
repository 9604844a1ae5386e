"""``SGLangEngine``: the production rollout engine — the :class:`RolloutEngine` API over K SGLang servers.

Configured by the run config's ``rollout.sglang`` section (:class:`dapo_megatron.config.SGLangConfig`); the servers
are launched or attached by URL (:meth:`SGLangEngine.launch`) and kept by
:class:`dapo_megatron.rollout.sglang.pool.ServerPool`.

Generation: one ``/generate`` request per prompt carrying its ``n`` samples (see
:mod:`dapo_megatron.rollout.sglang.requests` for the payload, the seed and the log-prob temperature semantics),
each to the server with the fewest requests in flight, while the samples in flight — of these and of streamed
requests together — stay within :attr:`SGLangEngine.in_flight` (``rollout.sglang.max_in_flight_samples``, by default
what the servers run at once: :func:`~dapo_megatron.rollout.sglang.pool.in_flight_samples`;
:mod:`dapo_megatron.rollout.sglang.in_flight`). SGLang batches concurrent requests itself.
With ``rollout.sglang.reply_processes: N > 0`` the sending threads only wait: the ``/generate`` call and its reply's
parsing run in N worker processes (:mod:`dapo_megatron.rollout.sglang.reply_workers`), created and closed here.

Failures: every HTTP call has ``request_timeout_s``; a failed server is restarted or taken out of rotation by the
pool (see there) and its lost requests are re-sent. A restart needs the weights of the current version: the
initial model for version 0, otherwise the disk transport's latest snapshot; the tensor and distributed transports
keep no copy, so with them a server that dies after the first update cannot be restored and is taken out of
rotation instead. ``request_timeout_s`` must therefore exceed the longest legitimate generation of one prompt.

Streaming (submit / poll / abort, requests in flight across weight updates): :mod:`dapo_megatron.rollout.sglang.stream`.

Weights: :meth:`SGLangEngine.update_weights` pauses every server (``mode="retract"``: streamed requests in flight
wait in the server's queue and resume on the new weights), flushes its cache, pushes the buckets through the
configured transport (:mod:`dapo_megatron.rollout.sglang.transports`), continues generation, and reads back each
server's ``weight_version`` (``/model_info``), raising :class:`RolloutError` on any mismatch. Every generated
sample's reported ``weight_version`` is checked as well.

Colocated servers (``placement="colocated"``, :mod:`dapo_megatron.rollout.placement`) release and resume their memory
in the trainer's turns (:meth:`SGLangEngine.before_generation`, :meth:`~SGLangEngine.after_generation`,
:meth:`~SGLangEngine.before_policy_update`; :meth:`~SGLangEngine.update_weights` resumes released weights before it
pushes). The engine tracks what each server released, sends only moves that state allows, and refuses to generate on
a server whose memory is released.
"""

from __future__ import annotations

import atexit
import logging
import math
import tempfile
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path
from typing import Iterable, Sequence

from tqdm import tqdm

from dapo_megatron.backend.base import Backend
from dapo_megatron.backend_registry import select_backend
from dapo_megatron.config import SGLangConfig
from dapo_megatron.hf_format import CONFIG_FILE, Bucket
from dapo_megatron.host_address import pin_gloo_interface, weight_update_address
from dapo_megatron.rollout.engine import (
    EngineHealth,
    FinishedRequest,
    GenerationRequest,
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
)
from dapo_megatron.rollout.placement import Placement, ServerMemory
from dapo_megatron.rollout.sglang.client import ServerFailure
from dapo_megatron.rollout.sglang.colocated_memory import ColocatedMemory
from dapo_megatron.rollout.sglang.in_flight import SampleBudget
from dapo_megatron.rollout.sglang.lora_adapters import ServedAdapters
from dapo_megatron.rollout.sglang.pool import ServerPool, ServerSlot, in_flight_samples
from dapo_megatron.rollout.sglang.reply_workers import ReplyWorkers, generate_samples
from dapo_megatron.rollout.sglang.requests import build_generate_payload, routing_topk, samples_from_outputs
from dapo_megatron.rollout.sglang.server import SGLangServerProcess, server_python
from dapo_megatron.rollout.sglang.stream import SGLangStreams
from dapo_megatron.rollout.sglang.transports import (
    DiskTransport,
    DistributedTransport,
    ServerTarget,
    TensorTransport,
    WeightTransport,
)

logger = logging.getLogger(__name__)


class SGLangEngine(RolloutEngine):
    """Rollouts on SGLang servers. See the module docstring for dispatch, failure handling and weight updates.

    :meth:`launch` launches (or attaches to) the servers of a config and makes the engine over them; the constructor
    takes the collaborators themselves: the ``pool`` of servers (not started: the engine starts it, and stops it at
    shutdown; its config, model directory, run directory, device and placement are the engine's) and the weight
    ``transport`` (default: the one ``rollout.sglang.transport`` names).
    ``temporary_dir``: a directory the engine removes at shutdown (the run directory :meth:`launch` made).
    """

    @classmethod
    def launch(cls, config: SGLangConfig, *, model_path: str | Path, run_dir: str | Path | None = None,
               show_progress: bool = True, dtype: str = "auto", backend: Backend | None = None,
               placement: Placement = "separate", server_gpus: list[range] | None = None) -> SGLangEngine:
        """The engine over the servers ``config`` launches or attaches.

        ``model_path``: the HF model directory the servers start from; the disk transport also copies its config and
        tokenizer files into every snapshot.
        ``run_dir``: server logs and config files, and by default the disk snapshots (``rollout.sglang.weight_dir``;
        must be readable by the servers, i.e. on a shared filesystem for remote ones); None: a temporary directory.
        ``dtype``: what launched servers compute in (SGLang's ``--dtype``; the trainer passes
        :func:`dapo_megatron.rollout.sglang.server.served_dtype` of its ``model.precision``).
        ``backend``: the platform's (:mod:`dapo_megatron.backend`; default: this machine's): servers run on its
        device type, in the environment it gives them.
        ``placement``: ``rollout.placement``; "colocated" servers share the trainer's GPUs and take turns with it.
        ``server_gpus``: each launched server's GPUs as the caller decided them (the trainer's colocation); None: the
        pool's own layout.
        """
        if not Path(model_path, CONFIG_FILE).is_file():
            raise ValueError(f"SGLangEngine: model_path {model_path} is not an HF model directory (no {CONFIG_FILE})")
        backend = select_backend() if backend is None else backend
        temporary_dir = None if run_dir else tempfile.TemporaryDirectory(prefix="dapo_sglang_")
        run_dir = Path(run_dir or temporary_dir.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        pool = ServerPool(config, model_path=str(model_path), run_dir=run_dir, device=backend.device_type,
                          dtype=dtype, server_environment=backend.sglang_server_environment, placement=placement,
                          server_gpus=server_gpus)
        return cls(pool, show_progress=show_progress, temporary_dir=temporary_dir)

    def __init__(self, pool: ServerPool, *, show_progress: bool = True, transport: WeightTransport | None = None,
                 temporary_dir: tempfile.TemporaryDirectory | None = None) -> None:
        self.pool = pool
        self.config: SGLangConfig = pool.config
        self.model_path = str(pool.model_path)
        self.run_dir = Path(pool.run_dir)
        self.device = pool.device
        self.placement: Placement = pool.placement
        self.show_progress = show_progress
        self.memory = ColocatedMemory(self.placement == "colocated")  # what each server released
        self._closed = False
        self._temp_dir = temporary_dir
        self._update_lock = threading.Lock()  # batch generation and weight updates take turns
        # A weight push and a server restart never overlap: a restart reads the served version and the weights to
        # relaunch from under it, and a push records its version before it lets go. Otherwise a server that failed
        # before a push and came back after it serves the weights of before (the initial model's while the first
        # push ran), outside the push's targets.
        self._serving_lock = threading.Lock()
        self._warned_unseeded = False
        self.transport: WeightTransport | None = None
        self.streams: SGLangStreams | None = None
        self.reply_workers: ReplyWorkers | None = None
        self._weight_version = 0  # until the pool reports the servers' version; shutdown reads it on a failed start
        # LoRA (model.lora.handoff: adapter): the adapters the servers hold and the one each request names
        self.adapters = ServedAdapters(lambda: [(slot.client, slot.tp_size) for slot in self.pool.available()])
        atexit.register(self.shutdown)
        try:
            self._weight_version = self.pool.start()
            config = self.config
            self.in_flight = SampleBudget(config.max_in_flight_samples
                                          or in_flight_samples(self.pool.capacities()))
            logger.info("up to %d samples in flight over %d server(s)", self.in_flight.limit, len(self.pool.slots))
            if config.reply_processes:  # a request holds at least one sample: at most `limit` calls at once
                self.reply_workers = ReplyWorkers(config.reply_processes, threads_per_process=math.ceil(
                    self.in_flight.limit / config.reply_processes))
            self.streams = SGLangStreams(self.pool, in_flight=self.in_flight,
                                         served_version=lambda: self._weight_version, on_failure=self.recover_server,
                                         reply_workers=self.reply_workers, adapters=self.adapters)
            self.transport = self._make_transport() if transport is None else transport
        except BaseException:
            self.shutdown()
            raise

    def _make_transport(self) -> WeightTransport:
        config = self.config
        if config.transport == "disk":
            weight_dir = Path(config.weight_dir) if config.weight_dir else self.run_dir / "weights"
            return DiskTransport(weight_dir, self.model_path)
        if config.transport == "tensor":
            return TensorTransport()
        backend = "nccl" if self.device == "cuda" else "gloo"
        address = weight_update_address(self.server_urls[0], config.weight_update_address)
        if backend == "gloo":
            pin_gloo_interface(address)
        return DistributedTransport(master_address=address, backend=backend, timeout_s=config.request_timeout_s,
                                    server_python=server_python(config))

    # ---- public state --------------------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def server_urls(self) -> list[str]:
        return self.pool.urls

    def server_processes(self) -> list[SGLangServerProcess]:
        """The processes this engine launched (empty when attached)."""
        return list(self.pool.processes)

    def restart_counts(self) -> list[int]:
        return [slot.restarts for slot in self.pool.slots]

    # ---- generation ------------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Sample]]:
        self._check_open()
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"SGLangEngine.generate: prompt {index} is empty")
        if not prompts:
            return []
        self.memory.require_can_generate(self.pool.available())
        seeded = params.seed is not None and self.pool.deterministic
        if params.seed is not None and not seeded and not self._warned_unseeded:
            logger.warning("SamplingParams.seed=%s is not honored: the SGLang servers do not run deterministic "
                           "inference (GPU-only in SGLang 0.5.23), so samples are not reproducible", params.seed)
            self._warned_unseeded = True
        results: list[list[Sample] | None] = [None] * len(prompts)
        with self._update_lock:
            workers = ThreadPoolExecutor(max_workers=min(self.in_flight.requests_at_once(params.n), len(prompts)),
                                         thread_name_prefix="sglang-generate")
            futures = {workers.submit(self._generate_one, index, prompt, params, seeded): index
                       for index, prompt in enumerate(prompts)}
            progress = tqdm(total=len(prompts), desc="sglang rollout", unit="prompt",
                            disable=not self.show_progress)
            try:
                pending = set(futures)
                while pending:
                    done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                    for future in done:
                        results[futures[future]] = future.result()  # re-raises a worker's RolloutError
                        progress.update(1)
            finally:
                progress.close()
                workers.shutdown(wait=False, cancel_futures=True)
        return results  # type: ignore[return-value]

    @property
    def return_routed_experts(self) -> bool:
        """R3 (algorithm.moe_routing_replay: replay_rollout): every request asks for its routing (requests.py), read
        into ``[tokens, layers, top-k]`` with the served model's top-k (:func:`routing_topk`)."""
        return self.streams is not None and self.streams.routed_topk is not None

    @return_routed_experts.setter
    def return_routed_experts(self, value: bool) -> None:
        self.streams.routed_topk = routing_topk(self.model_path) if value else None

    def _generate_one(self, index: int, prompt: Sequence[int], params: SamplingParams,
                      seeded: bool) -> list[Sample]:
        topk = self.streams.routed_topk
        # the samples' room first, then the adapter: a request waiting for room must not hold update_adapter back
        with self.in_flight.taken(params.n), self.adapters.request() as (adapter, _):
            payload = build_generate_payload(prompt, index, params, seeded=seeded, routed_experts=topk is not None,
                                             adapter=adapter)

            def generate_on(slot: ServerSlot) -> list[Sample]:
                return generate_samples(self.reply_workers, slot.client, payload, partial(
                    samples_from_outputs, prompt_index=index, expected_count=params.n,
                    expected_version=self._weight_version, server=slot.client.base_url,
                    routed_prompt_length=None if topk is None else len(prompt), routed_topk=topk or 0))

            return self.pool.send(generate_on, self.recover_server)

    # ---- streaming -------------------------------------------------------------------------------------------------
    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        self._check_open()
        self.memory.require_can_generate(self.pool.available())
        self.streams.submit(requests)

    def poll(self, timeout_s: float = 0.0) -> list[FinishedRequest]:
        return self.streams.poll(timeout_s)

    def abort(self, request_ids: Iterable[str]) -> None:
        self.streams.abort(request_ids)

    @property
    def num_in_flight(self) -> int:
        return self.streams.num_in_flight

    # ---- failover --------------------------------------------------------------------------------------------------
    def recover_server(self, slot: ServerSlot, generation: int, error: ServerFailure) -> None:
        """A request failed on ``slot``: relaunch its server with the served version's weights (the transport then
        forgets what it held for the old process), or take it out of rotation (:meth:`ServerPool.recover`). Waits
        for a weight push in progress, so the server comes back with the pushed weights."""
        if slot.generation != generation or not slot.available:
            return  # another thread handles (or handled) this failure; no need to wait for a push
        with self._serving_lock:
            # LoRA: the restarted server gets the adapters before it takes requests
            reload = {"after_restart": lambda client: self.adapters.reload(client, slot.tp_size)} \
                if self.adapters.enabled else {}
            if self.pool.recover(slot, generation, error, version=self._weight_version,
                                 restart_path=self._restart_model_path(), **reload):
                self.transport.reset()

    def _restart_model_path(self) -> str | None:
        """A model directory holding the served version's weights, to relaunch a failed server from (with LoRA
        adapters: the frozen base's, the adapters being loaded again after it)."""
        if self._weight_version == 0 or self.adapters.enabled:
            return self.model_path
        return self.transport.restart_model_path(self._weight_version)

    # ---- weights ---------------------------------------------------------------------------------------------------
    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"SGLangEngine.update_weights: version must be an int >= 0, got {version!r}")
        if version < self._weight_version:
            raise ValueError(f"SGLangEngine.update_weights: version {version} is older than the served "
                             f"version {self._weight_version}")
        with self._update_lock, self._serving_lock:
            slots = self.pool.available()
            if not slots:
                raise RolloutError("SGLangEngine.update_weights: no SGLang server is available")
            targets = server_targets(slots)
            started = time.monotonic()
            self.memory.move(slots, ServerMemory.for_weight_update, release=False)
            for target in targets:
                target.client.pause_generation(mode="retract")
                target.client.flush_cache()
            try:
                self.transport.push(targets, buckets, version)
            finally:
                failures = []
                for target in targets:
                    try:
                        target.client.continue_generation()
                    except RolloutError as error:
                        failures.append(str(error))
                if failures:
                    logger.error("continue_generation failed after a weight update: %s", "; ".join(failures))
            self._weight_version = version
            self.verify_served_version(version, slots)
            logger.info("weights v%d pushed to %d server(s) over %s in %.1f s", version, len(slots),
                        self.transport.name, time.monotonic() - started)

    def update_adapter(self, adapter, version: int) -> None:
        """Serve the LoRA ``adapter`` (on the base the servers hold) as ``version``: loaded on every server as
        ``policy_v<version>`` while requests in flight finish on the adapter they named; the older adapters are
        unloaded as their last request comes back (:mod:`.lora_adapters`). No pause: requests are bound to their
        adapter, not to the server's weights."""
        self._check_open()
        if version < self._weight_version:
            raise ValueError(f"SGLangEngine.update_adapter: version {version} is older than the served version "
                             f"{self._weight_version}")
        with self._update_lock, self._serving_lock:
            started = time.monotonic()
            slots = self.pool.available()
            if not slots:
                raise RolloutError("SGLangEngine.update_adapter: no SGLang server is available")
            # colocated: weights released for the update come back from the servers' host copy (the base)
            self.memory.move(slots, ServerMemory.for_weight_update, release=False)
            self.adapters.push(adapter, version)
            for slot in slots:
                slot.client.set_weight_version(str(version))
            self._weight_version = version
            self.verify_served_version(version, slots)
            logger.info("LoRA adapter v%d (%.1f MB) loaded on %d server(s) in %.1f s", version, adapter.nbytes / 1e6,
                        len(slots), time.monotonic() - started)

    # ---- turns on GPUs shared with the trainer (colocated placement) ------------------------------------------------
    def before_generation(self) -> None:
        with self._update_lock:
            self.memory.move(self.pool.available(), ServerMemory.for_generation, release=False)

    def after_generation(self) -> None:
        self._require_idle("after_generation")
        with self._update_lock:
            self.memory.move(self.pool.available(), ServerMemory.after_generation, release=True)

    def before_policy_update(self) -> None:
        self._require_idle("before_policy_update")
        with self._update_lock:
            self.memory.move(self.pool.available(), ServerMemory.for_training, release=True)

    def server_memory(self, slot: ServerSlot) -> ServerMemory:
        """What ``slot``'s server has released (a server restarted since holds everything again)."""
        return self.memory.of(slot)

    def _require_idle(self, turn: str) -> None:
        """A server releases memory only when idle (SGLang asserts it, and the failed assertion ends the server)."""
        if self.placement == "colocated" and self.streams.num_in_flight:
            raise RolloutError(f"SGLangEngine.{turn}: {self.streams.num_in_flight} streamed request(s) in flight; "
                               f"colocated servers release memory only when idle")

    def verify_served_version(self, expected: int | None = None, slots: Sequence[ServerSlot] | None = None) -> None:
        """Raise :class:`RolloutError` unless every available server reports ``weight_version == expected``."""
        expected = self._weight_version if expected is None else expected
        slots = self.pool.available() if slots is None else slots
        mismatches = []
        for slot in slots:
            served = slot.client.served_weight_version()
            if served != str(expected):
                mismatches.append(f"{slot.client.base_url} serves {served!r}")
        if mismatches:
            raise RolloutError(f"weight version mismatch after update to {expected}: {'; '.join(mismatches)}")

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    def health(self) -> EngineHealth:
        healthy, details = self.pool.health_details()
        return EngineHealth(healthy=healthy and not self._closed, weight_version=self._weight_version,
                            detail="; ".join(details) or "closed", servers=self.server_urls)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self.streams is not None:
            self.streams.close()
        if self.reply_workers is not None:
            self.reply_workers.close()
        transport = self.transport
        if transport is not None:
            try:
                transport.close(server_targets(self.pool.available()))
            except Exception as error:  # shutting down: report, keep killing servers
                logger.warning("closing the %s transport failed: %s", transport.name, error)
        self.pool.stop()
        if self._temp_dir is not None:
            self._temp_dir.cleanup()

    def _check_open(self) -> None:
        if self._closed:
            raise RolloutError("SGLangEngine was shut down")


def server_targets(slots: Sequence[ServerSlot]) -> list[ServerTarget]:
    """What a weight transport writes to, for each of ``slots``."""
    return [ServerTarget(client=slot.client, tp_size=slot.tp_size, same_host=slot.same_host,
                         gpus=slot.process.gpus if slot.process is not None else None) for slot in slots]
