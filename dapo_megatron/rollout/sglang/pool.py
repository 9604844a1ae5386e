"""The SGLang engine's servers: launched here or attached by URL, least-loaded dispatch, and failover.

Dispatch: each request goes to the available server with the fewest requests in flight
(:meth:`ServerPool.acquire` / :meth:`ServerPool.release`); while every server is restarting, callers wait.
:meth:`ServerPool.send` is the one retry loop both of the engine's ways to generate use: it sends, and when the
server fails it has the failure handled (:meth:`ServerPool.recover`, through the engine, which knows the weights to
restart from) and sends again to another server.

Failover (:meth:`ServerPool.recover`): a server that refuses connections, drops them or does not answer within
``request_timeout_s`` is declared failed. A server this pool launched is restarted (at most ``max_restarts`` times
over the pool's life) from the model directory the engine says holds the weights it served; an attached server,
one out of restarts, or one with no such directory is taken out of rotation and its requests go to the others.
With no server left, :class:`RolloutError` is raised.

Launched CUDA servers take the GPUs :func:`dapo_megatron.rollout.sglang.gpus.server_gpu_ranges` gives them (after the
trainer's, by default), or, colocated, the trainer's own (:func:`dapo_megatron.rollout.placement.colocated_gpu_ranges`,
started with SGLang's memory saver). Launched servers run on this host; an attached one does when its URL names this
host.

Capacity (:meth:`ServerPool.capacities`): the sequences each server decodes at once, as SGLang reports it — its
scheduler's running-request limit, which it sizes from its KV cache. How many samples the engine keeps in flight by
default (``rollout.sglang.max_in_flight_samples: null``) is :func:`in_flight_samples` of them: every server gets as
many as it runs, whatever the layout and however many samples a request carries
(:mod:`dapo_megatron.rollout.sglang.in_flight`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, TypeVar

import torch

from dapo_megatron.config import SGLangConfig
from dapo_megatron.launch_env import local_world_size
from dapo_megatron.rollout.engine import RolloutError
from dapo_megatron.rollout.placement import Placement, check_attached_server, colocated_gpu_ranges, uses_memory_saver
from dapo_megatron.rollout.sglang.client import ServerFailure, SGLangClient, SGLangServerError
from dapo_megatron.rollout.sglang.gpus import server_gpu_ranges
from dapo_megatron.rollout.sglang.server import (
    ServerEnvironment,
    SGLangServerProcess,
    require_sglang,
    server_python,
    unchanged_environment,
)

T = TypeVar("T")
FailureHandler = Callable[["ServerSlot", int, ServerFailure], None]
"""``(slot, generation, error)``: restart the failed server or take it out of rotation (:meth:`ServerPool.recover`)."""

logger = logging.getLogger(__name__)

DETERMINISTIC_FLAG = "--enable-deterministic-inference"


@dataclass
class ServerSlot:
    """One server as the dispatcher sees it. ``generation`` counts (re)starts, to ignore stale failure reports."""

    index: int
    client: SGLangClient
    tp_size: int
    same_host: bool  # runs on this host (CUDA tensors may then travel as IPC handles)
    process: SGLangServerProcess | None = None
    in_flight: int = 0
    restarts: int = 0
    generation: int = 0
    restarting: bool = False
    down_reason: str | None = None

    @property
    def available(self) -> bool:
        return self.down_reason is None and not self.restarting


def server_capacity(info: dict, url: str) -> int:
    """Sequences one server decodes at once, from its ``/server_info``: SGLang 0.5.23 reports its scheduler's
    running-request limit per data-parallel rank (``internal_states[*].effective_max_running_requests_per_dp``)."""
    states = info.get("internal_states")
    limits = [state.get("effective_max_running_requests_per_dp") for state in states or [] if isinstance(state, dict)]
    if not limits or not all(isinstance(limit, int) and limit > 0 for limit in limits):
        raise SGLangServerError(f"{url}/server_info reports no running-request limit (internal_states[*]."
                                f"effective_max_running_requests_per_dp, SGLang 0.5.23): set "
                                f"rollout.sglang.max_in_flight_samples")
    return sum(limits)


def in_flight_samples(capacities: list[int]) -> int:
    """Samples that fill every server's capacity: one sequence each (at least one)."""
    return max(1, sum(capacities))


def is_this_host(url: str) -> bool:
    """``url`` names this machine: a loopback address, or this host's name."""
    host = urllib.parse.urlsplit(url).hostname or ""
    return host in ("localhost", "::1", socket.gethostname(), socket.getfqdn()) or host.startswith("127.")


def read_api_key(config: SGLangConfig) -> str | None:
    """The key attached servers were started with (``rollout.sglang.api_key_file``), or None."""
    return Path(config.api_key_file).read_text().strip() if config.api_key_file else None


class ServerPool:
    """``config.urls`` non-empty: attach to those servers; otherwise launch ``config.num_servers`` on ``device``
    serving ``dtype`` (SGLang's ``--dtype``), in the environment ``server_environment`` makes of the one they
    would get (the backend's: :meth:`dapo_megatron.backend.base.Backend.sglang_server_environment`), placed as
    ``placement`` says (``rollout.placement``), on ``server_gpus`` when the caller placed them (the trainer's
    colocation decides once for every rank), else on this pool's layout of the GPUs."""

    def __init__(self, config: SGLangConfig, *, model_path: str, run_dir: Path, device: Literal["cpu", "cuda"],
                 dtype: str = "auto", server_environment: ServerEnvironment = unchanged_environment,
                 placement: Placement = "separate", server_gpus: list[range] | None = None) -> None:
        self.config = config
        self.placement = placement
        self.server_gpus = server_gpus
        self.server_environment = server_environment
        self.model_path = model_path
        self.run_dir = run_dir
        self.device = device
        self.dtype = dtype
        self.slots: list[ServerSlot] = []
        self.processes: list[SGLangServerProcess] = []  # launched here; stopped by stop()
        self.deterministic = False  # servers run deterministic inference (then seeds are honored)
        self._dispatch = threading.Condition()

    def start(self) -> int:
        """Launch or attach; return the weight version the servers serve."""
        return self._attach() if self.config.urls else self._launch()

    def _launch(self) -> int:
        config = self.config
        if self.device == "cuda" and self.server_gpus is not None:
            gpus = self.server_gpus
        elif self.device == "cuda":
            layout = colocated_gpu_ranges if self.placement == "colocated" else server_gpu_ranges
            gpus = layout(config, trainer_local_ranks=local_world_size(), visible_gpus=torch.cuda.device_count())
        else:
            gpus = [None] * config.num_servers
        require_sglang(server_python(config))
        for index in range(config.num_servers):
            process = SGLangServerProcess(config, model_path=self.model_path, index=index, run_dir=self.run_dir,
                                          weight_version="0", device=self.device, gpus=gpus[index],
                                          dtype=self.dtype, platform_environment=self.server_environment,
                                          memory_saver=uses_memory_saver(self.placement, self.device))
            self.processes.append(process)
            process.start()
        for process in self.processes:  # started together, so the startups overlap
            process.wait_until_ready()
            client = SGLangClient(process.url, process.api_key, config.request_timeout_s)
            self.slots.append(ServerSlot(index=process.index, client=client, tp_size=config.tp_per_server,
                                         same_host=True, process=process))
        self.deterministic = DETERMINISTIC_FLAG in config.extra_server_args
        logger.info("launched %d SGLang server(s): %s", len(self.slots), ", ".join(self.urls))
        return 0

    def _attach(self) -> int:
        config = self.config
        api_key = read_api_key(config)
        for index, url in enumerate(config.urls):
            client = SGLangClient(url, api_key, config.request_timeout_s)
            if not client.healthy(timeout_s=min(30.0, config.request_timeout_s)):
                raise SGLangServerError(f"SGLang server {url} is not healthy (GET /health failed)")
            self.slots.append(ServerSlot(index=index, client=client, tp_size=config.tp_per_server,
                                         same_host=is_this_host(url)))
        versions = {slot.client.served_weight_version() for slot in self.slots}
        if len(versions) != 1:
            raise SGLangServerError(f"attached servers serve different weight versions: {sorted(versions)}")
        version = versions.pop()
        if not version.isdigit():  # a fresh server says "default": these are the initial weights, version 0
            for slot in self.slots:
                slot.client.set_weight_version("0")
            version = "0"
        infos = [slot.client.server_info() for slot in self.slots]
        for slot, info in zip(self.slots, infos):
            if "tp_size" not in info:
                raise SGLangServerError(f"{slot.client.base_url}/server_info has no tp_size; is it an SGLang server?")
            slot.tp_size = int(info["tp_size"])
            if self.placement == "colocated":
                check_attached_server(slot.client.base_url, info)
        self.deterministic = all(bool(info.get("enable_deterministic_inference")) for info in infos)
        return int(version)

    # ---- state -------------------------------------------------------------------------------------------------
    def capacities(self) -> list[int]:
        """Each server's sequences decoded at once (:func:`server_capacity`)."""
        return [server_capacity(slot.client.server_info(), slot.client.base_url) for slot in self.slots]

    @property
    def urls(self) -> list[str]:
        return [slot.client.base_url for slot in self.slots]

    def available(self) -> list[ServerSlot]:
        return [slot for slot in self.slots if slot.available]

    def health_details(self) -> tuple[bool, list[str]]:
        """(every server answers, one line per server)."""
        details = []
        healthy = bool(self.slots)
        for slot in self.slots:
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
        return healthy, details

    # ---- dispatch ----------------------------------------------------------------------------------------------
    def acquire(self) -> tuple[ServerSlot, int]:
        """The available server with the fewest requests in flight (waits while servers restart)."""
        with self._dispatch:
            while True:
                available = self.available()
                if available:
                    slot = min(available, key=lambda s: (s.in_flight, s.index))
                    slot.in_flight += 1
                    return slot, slot.generation
                if all(slot.down_reason is not None for slot in self.slots):
                    reasons = "; ".join(f"server {s.index}: {s.down_reason}" for s in self.slots)
                    raise SGLangServerError(f"no SGLang server left to generate on ({reasons})")
                self._dispatch.wait(timeout=5.0)

    def release(self, slot: ServerSlot) -> None:
        with self._dispatch:
            slot.in_flight -= 1

    def send(self, call: Callable[[ServerSlot], T], on_failure: FailureHandler) -> T:
        """``call(slot)`` on the least-loaded server. When that server fails (:class:`ServerFailure`), ``on_failure``
        restarts it or takes it out of rotation, and ``call`` runs again on the next server; raises when none is left.
        """
        while True:
            slot, generation = self.acquire()
            try:
                return call(slot)
            except ServerFailure as error:
                failure = error
            finally:
                self.release(slot)
            on_failure(slot, generation, failure)

    # ---- failover ----------------------------------------------------------------------------------------------
    def recover(self, slot: ServerSlot, generation: int, error: Exception, *, version: int,
                restart_path: str | None, after_restart: Callable[[SGLangClient], None] | None = None) -> bool:
        """Restart ``slot``'s server from ``restart_path`` serving ``version``, or take it out of rotation.

        The first thread to report a failure does it; returns True when this call restarted the server.
        ``restart_path`` None: no model directory holds ``version`` (the transport keeps no copy).
        ``after_restart(client)``: what the restarted server needs before it takes requests (the LoRA adapters).
        """
        with self._dispatch:
            if slot.generation != generation or not slot.available:
                return False  # another thread already handles (or handled) this failure
            logger.warning("SGLang server %d (%s) failed: %s", slot.index, slot.client.base_url, error)
            if slot.process is None:
                slot.down_reason = f"attached server {slot.client.base_url} failed ({error})"
            elif slot.restarts >= self.config.max_restarts:
                slot.down_reason = f"failed after {slot.restarts} restart(s) ({error})"
            elif restart_path is None:
                slot.down_reason = (f"failed ({error}) and cannot be restarted: the weights of version {version} "
                                    f"were pushed over the {self.config.transport} transport, which keeps no copy "
                                    f"to relaunch from (use transport=disk)")
            if slot.down_reason is None:
                slot.restarting = True
                slot.restarts += 1
            self._dispatch.notify_all()
        if slot.down_reason is not None:
            if slot.process is not None:
                slot.process.stop()  # outside the lock: stopping takes seconds
            return False
        try:
            process = slot.process
            process.model_path = restart_path
            process.weight_version = str(version)
            started = time.monotonic()
            process.start()
            process.wait_until_ready()
            logger.warning("SGLang server %d restarted in %.0f s (restart %d of at most %d)", slot.index,
                           time.monotonic() - started, slot.restarts, self.config.max_restarts)
            new_client = SGLangClient(process.url, process.api_key, self.config.request_timeout_s)
            if after_restart is not None:
                after_restart(new_client)
            with self._dispatch:
                slot.client = new_client
                slot.generation += 1
            return True
        except RolloutError as restart_error:
            with self._dispatch:
                slot.down_reason = f"restart failed: {restart_error}"
            return False
        finally:
            with self._dispatch:
                slot.restarting = False
                self._dispatch.notify_all()

    def stop(self) -> None:
        for process in self.processes:
            process.stop()
