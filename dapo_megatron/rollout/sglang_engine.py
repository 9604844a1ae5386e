"""``SGLangEngine``: the production rollout engine, K SGLang servers launched here or attached by URL.

Generation: one ``/generate`` request per prompt carrying its ``n`` samples (see
:mod:`dapo_megatron.rollout.sglang_requests` for the payload, the seed and the log-prob temperature semantics),
sent by a pool of at most ``max_concurrent_requests`` threads, each to the server with the fewest requests in
flight. SGLang batches concurrent requests itself.

Failures: every HTTP call has ``request_timeout_s``; a server that refuses connections, drops them or does not
answer in time is declared failed. A server this engine launched is restarted (at most ``max_restarts`` times
over the engine's life) with the weights it served, and the lost requests are re-sent; an attached server, or one
out of restarts, is taken out of rotation and its requests go to the others. With no server left,
:class:`RolloutError` is raised. A restart needs the weights of the current version: the initial model for version
0, otherwise the disk transport's latest snapshot; the tensor and distributed transports keep no copy, so with them
a server that dies after the first update cannot be restored and is taken out of rotation instead.
``request_timeout_s`` must therefore exceed the longest legitimate generation of one prompt.

Weights: :meth:`SGLangEngine.update_weights` pauses every server, flushes its cache, pushes the tensors through the
configured transport (:mod:`dapo_megatron.rollout.sglang_transports`), continues generation, and reads back each
server's ``weight_version`` (``/model_info``), raising :class:`RolloutError` on any mismatch. Every generated
sample's reported ``weight_version`` is checked as well.
"""

from __future__ import annotations

import atexit
import logging
import tempfile
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Literal, Sequence

import torch
from tqdm import tqdm

from dapo_megatron.host_address import pin_gloo_interface, weight_update_address
from dapo_megatron.rollout.engine import EngineHealth, RolloutEngine, RolloutError, Sample, SamplingParams
from dapo_megatron.rollout.sglang_client import ServerFailure, SGLangClient
from dapo_megatron.rollout.sglang_requests import build_generate_payload, samples_from_outputs
from dapo_megatron.rollout.sglang_server import SGLangLaunchConfig, SGLangServerProcess, require_sglang
from dapo_megatron.rollout.sglang_transports import (
    DEFAULT_BUCKET_BYTES,
    DiskTransport,
    DistributedTransport,
    ServerTarget,
    TensorTransport,
    WeightTransport,
)

if TYPE_CHECKING:
    from dapo_megatron.config import SGLangConfig

logger = logging.getLogger(__name__)

TransportName = Literal["disk", "tensor", "distributed"]


@dataclass(frozen=True)
class SGLangEngineConfig:
    """Everything :class:`SGLangEngine` needs.

    ``model_path``: the HF model directory the servers start from; the disk transport also copies its config and
    tokenizer files into every snapshot. ``urls`` non-empty: attach to these servers (all started with
    ``api_key``) instead of launching ``num_servers``. ``run_dir``: server logs and config files, and by default the
    disk snapshots (``weight_dir``; must be readable by the servers, i.e. on a shared filesystem for remote ones).
    """

    model_path: str
    urls: tuple[str, ...] = ()
    api_key: str | None = None
    num_servers: int = 1
    launch: SGLangLaunchConfig = field(default_factory=SGLangLaunchConfig)
    transport: TransportName = "disk"
    run_dir: str | None = None
    weight_dir: str | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    distributed_backend: Literal["nccl", "gloo"] | None = None  # None: nccl for cuda servers, gloo for cpu
    distributed_master_address: str | None = None  # None: this host's address on the route to the first server
    request_timeout_s: float = 600.0
    max_restarts: int = 2
    max_concurrent_requests: int = 64
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.transport not in ("disk", "tensor", "distributed"):
            raise ValueError(f"SGLangEngineConfig.transport must be disk/tensor/distributed, got {self.transport!r}")
        if not self.urls and self.num_servers < 1:
            raise ValueError(f"SGLangEngineConfig.num_servers must be >= 1, got {self.num_servers}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"SGLangEngineConfig.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_restarts < 0:
            raise ValueError(f"SGLangEngineConfig.max_restarts must be >= 0, got {self.max_restarts}")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"SGLangEngineConfig.max_concurrent_requests must be >= 1, "
                             f"got {self.max_concurrent_requests}")
        if not Path(self.model_path, "config.json").is_file():
            raise ValueError(f"SGLangEngineConfig.model_path {self.model_path} is not an HF model directory "
                             f"(no config.json)")

    @classmethod
    def from_sglang_config(cls, config: "SGLangConfig", *, model_path: str, run_dir: str | None = None,
                           device: Literal["cpu", "cuda"] | None = None, dtype: str = "auto",
                           max_total_tokens: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                           show_progress: bool = True) -> "SGLangEngineConfig":
        """Map the run config's ``rollout.sglang`` section onto an engine config.

        ``device``: default cuda when torch sees a GPU. ``max_total_tokens``: the KV-cache size in tokens; on CPU it
        defaults to 16384 (otherwise SGLang sizes the cache from free RAM: gigabytes, and minutes to start).
        """
        import sys

        api_key = None
        if config.api_key_file:
            api_key = Path(config.api_key_file).read_text().strip()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if max_total_tokens is None and device == "cpu" and "--max-total-tokens" not in config.extra_server_args:
            max_total_tokens = 16384
        launch = SGLangLaunchConfig(
            python=config.python or sys.executable, tp_size=config.tp_per_server, device=device, dtype=dtype,
            host=config.host, base_port=config.base_port, max_total_tokens=max_total_tokens,
            startup_timeout_s=config.launch_timeout_s, extra_args=tuple(config.extra_server_args),
        )
        return cls(model_path=model_path, urls=tuple(config.urls), api_key=api_key, num_servers=config.num_servers,
                   launch=launch, transport=config.transport, run_dir=run_dir, weight_dir=config.weight_dir,
                   bucket_bytes=bucket_bytes, distributed_master_address=config.weight_update_address,
                   request_timeout_s=config.request_timeout_s,
                   max_restarts=config.max_restarts, max_concurrent_requests=config.max_concurrent_requests,
                   show_progress=show_progress)


@dataclass
class _ServerSlot:
    """One server as the dispatcher sees it. ``generation`` counts (re)starts, to ignore stale failure reports."""

    index: int
    client: SGLangClient
    tp_size: int
    process: SGLangServerProcess | None = None
    in_flight: int = 0
    restarts: int = 0
    generation: int = 0
    restarting: bool = False
    down_reason: str | None = None

    @property
    def available(self) -> bool:
        return self.down_reason is None and not self.restarting


class SGLangEngine(RolloutEngine):
    """Rollouts on SGLang servers. See the module docstring for dispatch, failure handling and weight updates."""

    def __init__(self, config: SGLangEngineConfig) -> None:
        self.config = config
        self._closed = False
        self._temp_dir = None if config.run_dir else tempfile.TemporaryDirectory(prefix="dapo_sglang_")
        self.run_dir = Path(config.run_dir or self._temp_dir.name)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._slots: list[_ServerSlot] = []
        self._processes: list[SGLangServerProcess] = []  # launched here; stopped by shutdown()
        self._dispatch = threading.Condition()
        self._update_lock = threading.Lock()
        self._warned_unseeded = False
        self._weight_version = 0
        self.deterministic = False  # servers run --enable-deterministic-inference (then seeds are honored)
        self.transport: WeightTransport | None = None
        atexit.register(self.shutdown)
        try:
            if config.urls:
                self._attach()
            else:
                self._launch()
            self.transport = self._make_transport()
        except BaseException:
            self.shutdown()
            raise

    # ---- construction ------------------------------------------------------------------------------------------
    def _launch(self) -> None:
        config = self.config
        require_sglang(config.launch.python)
        for index in range(config.num_servers):
            process = SGLangServerProcess(model_path=config.model_path, launch=config.launch, index=index,
                                          run_dir=self.run_dir, weight_version="0")
            self._processes.append(process)
            process.start()
        for process in self._processes:  # started together, so the startups overlap
            process.wait_until_ready()
            client = SGLangClient(process.url, process.api_key, config.request_timeout_s)
            self._slots.append(_ServerSlot(index=process.index, client=client, tp_size=config.launch.tp_size,
                                           process=process))
        self.deterministic = (config.launch.deterministic_inference
                              or "--enable-deterministic-inference" in config.launch.extra_args)
        logger.info("launched %d SGLang server(s): %s", len(self._slots), ", ".join(self.server_urls))

    def _attach(self) -> None:
        config = self.config
        for index, url in enumerate(config.urls):
            client = SGLangClient(url, config.api_key, config.request_timeout_s)
            if not client.healthy(timeout_s=min(30.0, config.request_timeout_s)):
                raise RolloutError(f"SGLang server {url} is not healthy (GET /health failed)")
            self._slots.append(_ServerSlot(index=index, client=client, tp_size=config.launch.tp_size))
        versions = {slot.client.served_weight_version() for slot in self._slots}
        if len(versions) != 1:
            raise RolloutError(f"attached servers serve different weight versions: {sorted(versions)}")
        version = versions.pop()
        if not version.isdigit():  # a fresh server says "default": these are the initial weights, version 0
            for slot in self._slots:
                slot.client.set_weight_version("0")
            version = "0"
        self._weight_version = int(version)
        infos = [slot.client.server_info() for slot in self._slots]
        for slot, info in zip(self._slots, infos):
            if "tp_size" not in info:
                raise RolloutError(f"{slot.client.base_url}/server_info has no tp_size; is it an SGLang server?")
            slot.tp_size = int(info["tp_size"])
        self.deterministic = all(bool(info.get("enable_deterministic_inference")) for info in infos)

    def _make_transport(self) -> WeightTransport:
        config = self.config
        if config.transport == "disk":
            weight_dir = Path(config.weight_dir) if config.weight_dir else self.run_dir / "weights"
            return DiskTransport(weight_dir, config.model_path)
        if config.transport == "tensor":
            return TensorTransport(bucket_bytes=min(config.bucket_bytes, 256 * 1024 * 1024))
        backend = config.distributed_backend or ("nccl" if config.launch.device == "cuda" else "gloo")
        address = weight_update_address(self.server_urls[0], config.distributed_master_address)
        if backend == "gloo":
            pin_gloo_interface(address)
        return DistributedTransport(master_address=address, backend=backend,
                                    bucket_bytes=config.bucket_bytes, timeout_s=config.request_timeout_s)

    # ---- public state --------------------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def server_urls(self) -> list[str]:
        return [slot.client.base_url for slot in self._slots]

    def server_processes(self) -> list[SGLangServerProcess]:
        """The processes this engine launched (empty when attached)."""
        return list(self._processes)

    def restart_counts(self) -> list[int]:
        return [slot.restarts for slot in self._slots]

    # ---- generation ------------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Sample]]:
        self._check_open()
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"SGLangEngine.generate: prompt {index} is empty")
        if not prompts:
            return []
        seeded = params.seed is not None and self.deterministic
        if params.seed is not None and not seeded and not self._warned_unseeded:
            logger.warning("SamplingParams.seed=%s is not honored: the SGLang servers do not run deterministic "
                           "inference (GPU-only in SGLang 0.5.23), so samples are not reproducible", params.seed)
            self._warned_unseeded = True
        results: list[list[Sample] | None] = [None] * len(prompts)
        with self._update_lock:
            pool = ThreadPoolExecutor(max_workers=min(self.config.max_concurrent_requests, len(prompts)),
                                      thread_name_prefix="sglang-generate")
            futures = {pool.submit(self._generate_one, index, prompt, params, seeded): index
                       for index, prompt in enumerate(prompts)}
            progress = tqdm(total=len(prompts), desc="sglang rollout", unit="prompt",
                            disable=not self.config.show_progress)
            try:
                pending = set(futures)
                while pending:
                    done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                    for future in done:
                        results[futures[future]] = future.result()  # re-raises a worker's RolloutError
                        progress.update(1)
            finally:
                progress.close()
                pool.shutdown(wait=False, cancel_futures=True)
        return results  # type: ignore[return-value]

    def _generate_one(self, index: int, prompt: Sequence[int], params: SamplingParams,
                      seeded: bool) -> list[Sample]:
        payload = build_generate_payload(prompt, index, params, seeded=seeded)
        while True:
            slot, generation = self._acquire_slot()
            try:
                outputs = slot.client.generate(payload)
            except ServerFailure as error:
                self._release_slot(slot)
                self._handle_failure(slot, generation, error)
                continue
            self._release_slot(slot)
            return samples_from_outputs(outputs, index, params.n, self._weight_version, slot.client.base_url)

    def _acquire_slot(self) -> tuple[_ServerSlot, int]:
        """The available server with the fewest requests in flight (waits while servers restart)."""
        with self._dispatch:
            while True:
                available = [slot for slot in self._slots if slot.available]
                if available:
                    slot = min(available, key=lambda s: (s.in_flight, s.index))
                    slot.in_flight += 1
                    return slot, slot.generation
                if all(slot.down_reason is not None for slot in self._slots):
                    reasons = "; ".join(f"server {s.index}: {s.down_reason}" for s in self._slots)
                    raise RolloutError(f"no SGLang server left to generate on ({reasons})")
                self._dispatch.wait(timeout=5.0)

    def _release_slot(self, slot: _ServerSlot) -> None:
        with self._dispatch:
            slot.in_flight -= 1

    def _handle_failure(self, slot: _ServerSlot, generation: int, error: Exception) -> None:
        """Restart ``slot``'s server or take it out of rotation; the first thread to report a failure does it."""
        with self._dispatch:
            if slot.generation != generation or not slot.available:
                return  # another thread already handles (or handled) this failure
            logger.warning("SGLang server %d (%s) failed: %s", slot.index, slot.client.base_url, error)
            model_path = self._restart_model_path()
            if slot.process is None:
                slot.down_reason = f"attached server {slot.client.base_url} failed ({error})"
            elif slot.restarts >= self.config.max_restarts:
                slot.down_reason = f"failed after {slot.restarts} restart(s) ({error})"
            elif model_path is None:
                slot.down_reason = (f"failed ({error}) and cannot be restarted: the weights of version "
                                    f"{self._weight_version} were pushed over the {self.config.transport} "
                                    f"transport, which keeps no copy to relaunch from (use transport=disk)")
            if slot.down_reason is None:
                slot.restarting = True
                slot.restarts += 1
            self._dispatch.notify_all()
        if slot.down_reason is not None:
            if slot.process is not None:
                slot.process.stop()  # outside the lock: stopping takes seconds
            return
        try:
            process = slot.process
            process.model_path = model_path
            process.weight_version = str(self._weight_version)
            started = time.monotonic()
            process.start()
            process.wait_until_ready()
            logger.warning("SGLang server %d restarted in %.0f s (restart %d of at most %d)", slot.index,
                           time.monotonic() - started, slot.restarts, self.config.max_restarts)
            new_client = SGLangClient(process.url, process.api_key, self.config.request_timeout_s)
            with self._dispatch:
                slot.client = new_client
                slot.generation += 1
            self.transport.reset()
        except RolloutError as restart_error:
            with self._dispatch:
                slot.down_reason = f"restart failed: {restart_error}"
        finally:
            with self._dispatch:
                slot.restarting = False
                self._dispatch.notify_all()

    def _restart_model_path(self) -> str | None:
        if self._weight_version == 0:
            return self.config.model_path
        return self.transport.restart_model_path(self._weight_version)

    # ---- weights ---------------------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"SGLangEngine.update_weights: version must be an int >= 0, got {version!r}")
        if version < self._weight_version:
            raise ValueError(f"SGLangEngine.update_weights: version {version} is older than the served "
                             f"version {self._weight_version}")
        with self._update_lock:
            slots = [slot for slot in self._slots if slot.available]
            if not slots:
                raise RolloutError("SGLangEngine.update_weights: no SGLang server is available")
            targets = [ServerTarget(client=slot.client, tp_size=slot.tp_size) for slot in slots]
            started = time.monotonic()
            for target in targets:
                target.client.pause_generation()
                target.client.flush_cache()
            try:
                self.transport.push(targets, named_tensors, version)
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

    def verify_served_version(self, expected: int | None = None, slots: Sequence[_ServerSlot] | None = None) -> None:
        """Raise :class:`RolloutError` unless every available server reports ``weight_version == expected``."""
        expected = self._weight_version if expected is None else expected
        slots = [slot for slot in self._slots if slot.available] if slots is None else slots
        mismatches = []
        for slot in slots:
            served = slot.client.served_weight_version()
            if served != str(expected):
                mismatches.append(f"{slot.client.base_url} serves {served!r}")
        if mismatches:
            raise RolloutError(f"weight version mismatch after update to {expected}: {'; '.join(mismatches)}")

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    def health(self) -> EngineHealth:
        details = []
        healthy = bool(self._slots) and not self._closed
        for slot in self._slots:
            if slot.down_reason is not None:
                state = f"down: {slot.down_reason}"
                healthy = False
            elif slot.restarting:
                state = "restarting"
                healthy = False
            elif slot.client.healthy():
                state = f"ok (restarts {slot.restarts})"
            else:
                state = "not answering"
                healthy = False
            details.append(f"server {slot.index} {slot.client.base_url}: {state}")
        return EngineHealth(healthy=healthy, weight_version=self._weight_version,
                            detail="; ".join(details) or "closed", servers=self.server_urls)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        transport = self.transport
        if transport is not None:
            try:
                transport.close([ServerTarget(client=s.client, tp_size=s.tp_size) for s in self._slots
                                 if s.available])
            except Exception as error:  # shutting down: report, keep killing servers
                logger.warning("closing the %s transport failed: %s", transport.name, error)
        for process in self._processes:
            process.stop()
        if self._temp_dir is not None:
            self._temp_dir.cleanup()

    def _check_open(self) -> None:
        if self._closed:
            raise RolloutError("SGLangEngine was shut down")
