"""Async mode's two races on the SGLang side (issue 26, item 5): a stream worker recovering a server while the
trainer's thread pushes weights.

* The distributed transport's ``reset()`` (a stream worker calls it after a restart) destroyed the process group at
  once, also while the trainer's thread was broadcasting on it. Now it only marks the group; the next push tears it
  down under the lock a push holds.
* A server restart that overlapped a push read the version served before the push (the engine recorded the new one
  only after it), so the server came back with the old weights (the initial model's during the first push) and
  outside the push's targets. Now a restart waits for the push and relaunches from its version.

Both need the restart to start inside a push, a window a real server cannot be made to hit on demand, so the
transport's process group (where it is opened, broadcast on and destroyed) and the engine's pool and transport (its
constructor's arguments) are stood in for; their real counterparts run in tests/integration/test_sglang_server.py and
tests/integration/test_sglang_streaming.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dapo_megatron.config import SGLangConfig
from dapo_megatron.rollout.sglang.client import ServerFailure
from dapo_megatron.rollout.sglang import transports
from dapo_megatron.rollout.sglang.engine import SGLangEngine
from dapo_megatron.rollout.sglang.transports import DistributedTransport, ServerTarget

WAIT_S = 10.0


class Client:
    """A server's control calls, all answered at once."""

    def __init__(self, url: str, version: str = "0") -> None:
        self.base_url = url
        self.version = version

    def begin_weight_update(self):
        pass

    def end_weight_update(self):
        pass

    def flush_cache(self):
        pass

    def set_weight_version(self, version):
        self.version = version

    def init_weights_update_group(self, **_):
        pass

    def update_weights_from_distributed(self, **_):
        pass

    def pause_generation(self, mode):
        pass

    def continue_generation(self):
        pass

    def served_weight_version(self):
        return self.version


def _bucket():
    return [[("w", torch.ones(2))]]


class Broadcast:
    """A broadcast in flight (torch's async work), complete once the test releases it."""

    def __init__(self, release: threading.Event, broadcasting: threading.Event) -> None:
        self.release, self.broadcasting = release, broadcasting

    def is_completed(self) -> bool:
        if self.release.is_set():
            self.broadcasting.clear()
        return self.release.is_set()

    def wait(self) -> None:
        pass


def test_a_reset_during_a_broadcast_leaves_the_group_to_the_push(monkeypatch):
    transport = DistributedTransport()
    servers = [ServerTarget(Client("a"), tp_size=1)]
    groups, destroyed, broadcasting = [], [], threading.Event()
    started, release = threading.Event(), threading.Event()

    def open_group(**_):
        groups.append(object())
        return groups[-1]

    def broadcast(tensor, src, group, async_op):
        broadcasting.set()
        started.set()
        return Broadcast(release, broadcasting)

    # the process group stood in for where the transport opens, uses and destroys it
    monkeypatch.setattr(transports, "open_sender_group", open_group)
    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    monkeypatch.setattr(torch.distributed, "destroy_process_group",
                        lambda group: destroyed.append((group, broadcasting.is_set())))
    push = threading.Thread(target=transport.push, args=(servers, iter(_bucket()), 1))
    push.start()
    assert started.wait(WAIT_S)
    transport.reset()  # a stream worker restarted a server meanwhile
    assert destroyed == []  # the broadcast in progress keeps its group
    release.set()
    push.join(WAIT_S)
    assert not push.is_alive() and len(groups) == 1

    release.set()
    transport.push(servers, iter(_bucket()), 2)  # the next push forms a new group, destroying the old one first
    assert destroyed == [(groups[0], False)] and len(groups) == 2
    transport.push(servers, iter(_bucket()), 3)  # control: without a reset the group is kept
    assert len(groups) == 2 and len(destroyed) == 1


class Slot:
    def __init__(self, index: int, client: Client) -> None:
        self.index, self.client, self.tp_size, self.same_host, self.process = index, client, 1, True, None
        self.generation, self.available = 0, True


class Pool:
    """The engine's pool: two servers serving ``version``; a recovery records which weights the server would be
    relaunched with."""

    def __init__(self, version: int = 0) -> None:
        self.config, self.model_path, self.run_dir = SGLangConfig(), "initial-model", "run"
        self.device, self.placement = "cpu", "separate"
        self.version = version
        self.slots = [Slot(0, Client("a", str(version))), Slot(1, Client("b", str(version)))]
        self.restarts: list[tuple[int, str | None]] = []
        self.stopped = False

    def start(self) -> int:
        return self.version

    def capacities(self) -> list[int]:
        return [1 for _ in self.slots]

    def available(self):
        return list(self.slots)

    def stop(self) -> None:
        self.stopped = True

    def recover(self, slot, generation, error, *, version, restart_path):
        self.restarts.append((version, restart_path))
        slot.client.version = str(version)
        return True


class Transport:
    """A disk transport whose push waits until released, and whose snapshot of version v is ``snapshot/v{v}``."""

    name = "disk"

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.latest: int | None = None
        self.resets = 0

    def push(self, targets, buckets, version):
        self.started.set()
        assert self.release.wait(WAIT_S)
        for target in targets:
            target.client.set_weight_version(str(version))
        self.latest = version

    def restart_model_path(self, version):
        return f"snapshot/v{version}" if self.latest == version else None

    def reset(self):
        self.resets += 1

    def close(self, targets):
        pass


@pytest.fixture
def engine_on():
    """``engine_on(pool, transport)``: an SGLangEngine over stand-ins for its pool and transport (see the module
    docstring), shut down after the test."""
    engines = []

    def make(pool: Pool, transport: Transport) -> SGLangEngine:
        engines.append(SGLangEngine(pool, show_progress=False, transport=transport))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()
        assert engine.pool.stopped


def pushing_version_1(engine: SGLangEngine, transport: Transport) -> threading.Thread:
    """A thread in ``engine.update_weights(..., 1)``, inside its push once this returns."""
    update = threading.Thread(target=engine.update_weights, args=(iter(_bucket()), 1))
    update.start()
    assert transport.started.wait(WAIT_S)
    return update


def test_a_server_restarted_during_a_push_comes_back_with_the_pushed_weights(engine_on):
    pool, transport = Pool(), Transport()
    engine = engine_on(pool, transport)
    update = pushing_version_1(engine, transport)
    failed = pool.slots[1]
    recovery = threading.Thread(target=engine.recover_server, args=(failed, 0, ServerFailure("connection reset")))
    recovery.start()
    time.sleep(0.3)
    assert pool.restarts == []  # it waits for the push instead of relaunching from the weights of before
    transport.release.set()
    update.join(WAIT_S)
    recovery.join(WAIT_S)
    assert not update.is_alive() and not recovery.is_alive()
    assert pool.restarts == [(1, "snapshot/v1")] and transport.resets == 1
    assert engine.weight_version == 1


def test_a_failure_another_thread_already_handles_does_not_wait_for_a_push(engine_on):
    pool, transport = Pool(), Transport()
    engine = engine_on(pool, transport)
    update = pushing_version_1(engine, transport)
    restarting = pool.slots[1]
    restarting.available = False  # being restarted by the thread that reported first
    started = time.monotonic()
    engine.recover_server(restarting, 0, ServerFailure("connection reset"))
    assert time.monotonic() - started < 1.0 and pool.restarts == []
    transport.release.set()
    update.join(WAIT_S)


@pytest.mark.parametrize("version", [0, 3])
def test_control_without_a_push_a_restart_uses_the_served_weights(engine_on, version):
    pool, transport = Pool(version), Transport()
    transport.latest = version
    engine = engine_on(pool, transport)
    assert engine.weight_version == version  # what the pool's servers serve
    engine.recover_server(pool.slots[0], 0, ServerFailure("connection reset"))
    assert pool.restarts == [(version, "initial-model" if version == 0 else f"snapshot/v{version}")]
