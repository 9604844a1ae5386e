"""The three ways full HF-named weights reach SGLang servers.

The engine (:class:`.engine.SGLangEngine`) pauses every server and flushes its cache
before calling :meth:`WeightTransport.push`, and continues generation and checks the served ``weight_version``
after it. A transport consumes the buckets of ``(hf_name, tensor)`` pairs as the exporter made them (it never
re-buckets) and sends every bucket to every server before pulling the next one, so the trainer never holds more
than one bucket. Full tensors are sent; SGLang shards them for its own TP degree.

* :class:`DiskTransport` — one safetensors shard per bucket + index + config and tokenizer files into
  ``snapshot_root/v{version}`` (a complete HF model directory written by :func:`dapo_megatron.hf_format.
  write_hf_folder`, on a filesystem the servers can read), then ``/update_weights_from_disk``.
  Works across hosts and is the one a restarted server can be relaunched from (:meth:`restart_model_path`).
* :class:`TensorTransport` — ``/update_weights_from_tensor`` with one payload per server TP rank
  (:mod:`.tensor_payloads`): CUDA IPC handles for GPU buckets going to a server on this host,
  the last :data:`IPC_WINDOW_BUCKETS` of them kept referenced here (:class:`HandleWindow`); pickled CPU copies
  otherwise (any host, through the HTTP body).
* :class:`DistributedTransport` — a process group formed by ``/init_weights_update_group`` (rank 0 here, the
  servers' TP ranks after it), then per bucket ``/update_weights_from_distributed`` announcing names/dtypes/shapes
  while this process broadcasts each tensor from rank 0. NCCL on GPUs; gloo on CPU (SGLang passes the backend
  through to its process-group constructor).

SGLang 0.5.23 accepts tensor and distributed updates only between ``/begin_weight_update`` and
``/end_weight_update`` (:func:`weight_update_session`). Which bucket is the last is known only once the stream
ends, so after the session every server flushes its prefix cache and is tagged with the new ``weight_version``
(:func:`tag_version`).
"""

from __future__ import annotations

import abc
import contextlib
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch.distributed import distributed_c10d as c10d

from dapo_megatron.hf_format import CONFIG_FILE, Bucket, checked_buckets, write_hf_folder
from dapo_megatron.rollout.engine import RolloutError
from dapo_megatron.rollout.sglang.runtime_versions import require_server_runtime_matches
from dapo_megatron.rollout.sglang.client import SGLangClient
from dapo_megatron.rollout.sglang.server import find_free_port
from dapo_megatron.rollout.sglang.tensor_payloads import BucketPayloads


@dataclass
class ServerTarget:
    """A server a transport writes to: its client, TP degree (the number of group ranks it contributes), and
    whether it runs on this host (CUDA tensors may then travel as IPC handles)."""

    client: SGLangClient
    tp_size: int
    same_host: bool = False
    gpus: range | None = None  # its TP ranks' GPUs, when launched here (CUDA handles go only to the bucket's GPU)


def on_all_servers(servers: Sequence[ServerTarget], call: Callable[[ServerTarget], None]) -> None:
    """Run ``call(server)`` for every server concurrently; re-raise the first failure."""
    if len(servers) == 1:
        call(servers[0])
        return
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        for future in [pool.submit(call, server) for server in servers]:
            future.result()


@contextlib.contextmanager
def weight_update_session(servers: Sequence[ServerTarget]) -> Iterator[None]:
    """``/begin_weight_update`` ... ``/end_weight_update`` on every server."""
    on_all_servers(servers, lambda server: server.client.begin_weight_update())
    try:
        yield
    finally:
        on_all_servers(servers, lambda server: server.client.end_weight_update())


def tag_version(servers: Sequence[ServerTarget], version: int) -> None:
    """After a complete update: flush every server's prefix cache and tag its weights ``str(version)``."""
    def tag(server: ServerTarget) -> None:
        server.client.flush_cache()
        server.client.set_weight_version(str(version))

    on_all_servers(servers, tag)


class WeightTransport(abc.ABC):
    """Moves one full set of HF-named weights to servers that are paused and flushed."""

    name: str

    def push(self, servers: Sequence[ServerTarget], buckets: Iterable[Bucket], version: int) -> None:
        """Load the weights of ``buckets`` into every server and tag them ``str(version)``; a bucket with a
        non-tensor or a name seen before, or no tensor at all, is an error."""
        self.send(servers, checked_buckets(buckets), version)

    @abc.abstractmethod
    def send(self, servers: Sequence[ServerTarget], buckets: Iterator[Bucket], version: int) -> None:
        """:meth:`push` with the buckets checked."""

    def restart_model_path(self, version: int) -> str | None:
        """A model directory with the weights of ``version`` to relaunch a server from, if this transport has one."""
        return None

    def reset(self) -> None:
        """Forget per-server state (called after a server restarts). Stateless transports have none."""

    def close(self, servers: Sequence[ServerTarget]) -> None:
        """Release what the transport holds (process groups, ...)."""


# ---------------------------------------------------------------------------------------------------------------
class DiskTransport(WeightTransport):
    """Write a complete HF directory per version; servers reload from it. Keeps the newest snapshot only."""

    name = "disk"

    def __init__(self, snapshot_root: str | Path, hf_config_dir: str | Path) -> None:
        self.snapshot_root = Path(snapshot_root)
        self.hf_config_dir = Path(hf_config_dir)
        if not (self.hf_config_dir / CONFIG_FILE).is_file():
            raise ValueError(f"DiskTransport: hf_config_dir {self.hf_config_dir} has no {CONFIG_FILE}")
        self._latest: tuple[int, Path] | None = None

    def snapshot_dir(self, version: int) -> Path:
        return self.snapshot_root / f"v{version}"

    def write_snapshot(self, buckets: Iterable[Bucket], version: int) -> Path:
        """Write ``v{version}``: one safetensors shard per bucket, their index, and the HF config dir's side files
        (config, generation config, tokenizer). Memory: the bucket being written. The folder is built under a
        temporary name and renamed at the end, so a server never reads a half-written snapshot."""
        return write_hf_folder(self.snapshot_dir(version), buckets, side_files_from=self.hf_config_dir, replace=True)

    def send(self, servers, buckets, version):
        path = self.write_snapshot(buckets, version)
        on_all_servers(servers, lambda server: server.client.update_weights_from_disk(str(path), str(version)))
        previous, self._latest = self._latest, (version, path)
        if previous is not None and previous[1] != path:
            shutil.rmtree(previous[1], ignore_errors=True)

    def restart_model_path(self, version):
        if self._latest is not None and self._latest[0] == version:
            return str(self._latest[1])
        return None


# ---------------------------------------------------------------------------------------------------------------
IPC_WINDOW_BUCKETS = 2
"""Buckets sent as CUDA handles that the tensor transport keeps referenced after every server answered for them."""


def collect_ipc_memory() -> None:
    """Free the CUDA blocks sent as IPC handles that this process dropped and every consumer has released
    (``torch.cuda.ipc_collect``); nothing to do in a process that never initialized CUDA."""
    if torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


class HandleWindow:
    """The last ``size`` buckets sent as CUDA IPC handles, kept referenced; older ones are dropped and collected.

    Why dropping is safe once every server answered for a bucket: SGLang 0.5.23's ``/update_weights_from_tensor``
    answers after the server deserialized the handles and loaded (enqueued its copies from) them, and its references
    die with that call; torch's consumer side synchronizes the server's stream before it gives its reference back,
    and a block this process drops while a consumer still holds it waits in torch's limbo until the consumers' count
    reaches 0 (torch/csrc/CudaIPCTypes.cpp). ``torch.cuda.ipc_collect`` then returns it to the caching allocator, so
    the extra GPU memory of a handoff is a few buckets, not the whole model."""

    def __init__(self, size: int = IPC_WINDOW_BUCKETS, collect: Callable[[], None] = collect_ipc_memory) -> None:
        self.size = size
        self.collect = collect
        self._held: list[BucketPayloads] = []

    def keep(self, payloads: BucketPayloads) -> None:
        self._held.append(payloads)
        if len(self._held) > self.size:
            del self._held[:-self.size]
            self.collect()

    def release(self) -> None:
        self._held.clear()
        self.collect()


class TensorTransport(WeightTransport):
    """``/update_weights_from_tensor`` per bucket, one payload per server TP rank (:mod:`.tensor_payloads`)."""

    name = "tensor"

    def __init__(self, ipc_window_buckets: int = IPC_WINDOW_BUCKETS,
                 collect: Callable[[], None] = collect_ipc_memory) -> None:
        self.ipc_window_buckets = ipc_window_buckets
        self.collect = collect

    def send(self, servers, buckets, version):
        window = HandleWindow(self.ipc_window_buckets, self.collect)  # buckets sent as CUDA handles
        try:
            with weight_update_session(servers):
                for bucket in buckets:
                    payloads = BucketPayloads(bucket, servers)
                    on_all_servers(servers, lambda server, sent=payloads: server.client.update_weights_from_tensor(
                        sent.for_server(server), version=None, flush_cache=False))
                    if payloads.by_reference:
                        window.keep(payloads)
                    del payloads  # a bucket sent by value is released here: the trainer holds one at a time
        finally:
            window.release()
        tag_version(servers, version)


# ---------------------------------------------------------------------------------------------------------------
def open_sender_group(*, master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
                      timeout: timedelta) -> torch.distributed.ProcessGroup:
    """Join the weight-update group as rank 0, the way SGLang's ``init_custom_process_group`` joins it.

    The group is independent of any default process group this process may have (Megatron's): this process hosts the
    TCP store on ``master_address:master_port`` that the servers' ``tcp://`` rendezvous dials, its keys prefixed with
    ``group_name`` like the servers' side, and the group is registered so ``torch.distributed.broadcast(group=...)``
    accepts it. That needs torch's private ``_new_process_group_helper``, the call SGLang makes on the other end;
    both ends must run the same torch version.

    The store is made here rather than by ``c10d.rendezvous``: under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``)
    the rendezvous makes rank 0 a client of a store it expects torchrun's agent to host on that port, nobody hosts
    it, and the group would wait out ``timeout`` (torch/distributed/rendezvous.py, ``_create_c10d_store``).
    """
    store = torch.distributed.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout)
    group, _ = c10d._new_process_group_helper(
        world_size, 0, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store),
        group_name=group_name, backend_options=None, timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


GROUP_TIMEOUT_FACTOR = 2
"""The weight-update group's collective timeout, in units of the transport's own broadcast deadline."""


class DistributedTransport(WeightTransport):
    """Broadcast each bucket from rank 0 of a group spanning this process and every server TP rank."""

    name = "distributed"

    def __init__(self, *, master_address: str = "127.0.0.1", master_port: int = 0, backend: str = "gloo",
                 group_name: str = "dapo_weight_update", timeout_s: float = 600.0,
                 server_python: str | None = None) -> None:
        self.master_address = master_address
        self.server_python = server_python  # the servers' interpreter, whose torch/NCCL must equal ours
        self.master_port = master_port
        self.backend = backend
        self.group_name_prefix = group_name
        self.group_name = group_name
        self.timeout_s = timeout_s
        self._groups_formed = 0
        self._group: torch.distributed.ProcessGroup | None = None
        self._group_servers: list[ServerTarget] = []
        self._stale = False  # reset() was called: the next push forms a new group
        self._lock = threading.Lock()  # held by a push (and close): the group is never torn down under a broadcast

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def connect(self, servers: Sequence[ServerTarget]) -> None:
        """Form the group: every server joins with ranks from its ``rank_offset`` while this process joins as 0."""
        if self.server_python is not None:
            require_server_runtime_matches(self.server_python, backend=self.backend)
        port = self.master_port or find_free_port(self.master_address)
        # A fresh name per group: servers that outlived a previous group still hold it under the old name.
        self._groups_formed += 1
        self.group_name = f"{self.group_name_prefix}_{self._groups_formed}"
        world_size = 1 + sum(server.tp_size for server in servers)
        offsets = [1 + sum(s.tp_size for s in servers[:i]) for i in range(len(servers))]
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            joins = [pool.submit(server.client.init_weights_update_group, master_address=self.master_address,
                                 master_port=port, rank_offset=offset, world_size=world_size,
                                 group_name=self.group_name, backend=self.backend)
                     for server, offset in zip(servers, offsets)]
            try:
                # twice the broadcast's own deadline: NCCL's watchdog ends the whole process when a collective
                # outlives the group's timeout, and the deadline (_broadcast) must raise its RolloutError first
                group = open_sender_group(master_address=self.master_address, master_port=port,
                                          world_size=world_size, group_name=self.group_name, backend=self.backend,
                                          timeout=timedelta(seconds=GROUP_TIMEOUT_FACTOR * self.timeout_s))
            except Exception as error:
                raise RolloutError(f"could not form the weight-update group ({self.backend}, world {world_size}) "
                                   f"at {self.master_address}:{port}: {error}") from error
            for join in joins:
                join.result()
        self._group, self._group_servers = group, list(servers)

    def send(self, servers, buckets, version):
        with self._lock:
            urls = [server.client.base_url for server in servers]
            if self._stale or self._group is None or [s.client.base_url for s in self._group_servers] != urls:
                self._stale = False  # before connecting: a reset() from now on is for the group formed next
                self._drop_group()
                self.connect(servers)
            with weight_update_session(servers):
                for bucket in buckets:
                    self._send_bucket(servers, bucket)
            tag_version(servers, version)

    def _send_bucket(self, servers: Sequence[ServerTarget], bucket: Bucket) -> None:
        """Announce the bucket to every server (in threads: the calls return after the broadcast) and broadcast it."""
        names = [name for name, _ in bucket]
        dtypes = [str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket]
        shapes = [list(tensor.shape) for _, tensor in bucket]
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            announcements = [pool.submit(server.client.update_weights_from_distributed, names=names, dtypes=dtypes,
                                         shapes=shapes, group_name=self.group_name, version=None,
                                         flush_cache=False)
                             for server in servers]
            try:
                self._broadcast(bucket, announcements)
            except Exception as error:
                self._drop_group()  # under send's lock
                rejected = [a.exception() for a in announcements if a.done() and a.exception() is not None]
                said = f"; the server said: {rejected[0]}" if rejected else ""
                raise RolloutError(f"weight broadcast over the {self.backend} group failed: {error}{said}") from error
            for announcement in announcements:
                announcement.result()

    def _broadcast(self, bucket: Bucket, announcements: list[Future]) -> None:
        """Broadcast the bucket from rank 0 without blocking on the collective, so a server that rejects the
        announcement (its HTTP reply arrives meanwhile) ends the wait at once instead of after the group timeout."""
        sent = [tensor.detach().to(self.device).contiguous() for _, tensor in bucket]
        works = [torch.distributed.broadcast(tensor, src=0, group=self._group, async_op=True) for tensor in sent]
        deadline = time.monotonic() + self.timeout_s
        while not all(work.is_completed() for work in works):
            if any(a.done() and a.exception() is not None for a in announcements):
                raise RolloutError("a server rejected the bucket")
            if time.monotonic() > deadline:
                raise RolloutError(f"broadcast did not complete in {self.timeout_s:.0f} s")
            time.sleep(0.005)
        for work in works:
            work.wait()

    def reset(self) -> None:
        """Restarted servers lost their end of the group: the next push forms a new one. Any thread may call this
        (a stream worker recovers a server while the trainer's thread may be broadcasting): it only marks the group,
        which the next push, holding the lock a push holds, tears down."""
        self._stale = True

    def _drop_group(self) -> None:
        """Destroy the local end of the group; only with ``_lock`` held."""
        if self._group is not None:
            try:
                torch.distributed.destroy_process_group(self._group)
            except Exception:  # the peers may be gone; nothing is left to release then
                pass
        self._group, self._group_servers = None, []

    def close(self, servers):
        with self._lock:
            if self._group is None:
                return
            for server in self._group_servers:
                try:
                    server.client.destroy_weights_update_group(self.group_name)
                except RolloutError:
                    pass
            self._drop_group()
