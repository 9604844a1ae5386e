"""A colocated server releases memory only after its scheduler is idle (rollout/sglang/engine.py): SGLang 0.5.23
asserts ``is_fully_idle()`` in the release, which with the overlap scheduler clears one batch after the last reply;
the engine first waits for idle (``/flush_cache?timeout=``) and releases only when that succeeded.

The servers are stand-ins recording their calls: on CPU the idle race cannot be produced on demand. The real endpoint
runs in tests/integration/test_sglang_colocated.py."""

import pytest

from dapo_megatron.config import SGLangConfig
from dapo_megatron.rollout.engine import RolloutError
from dapo_megatron.rollout.sglang.client import ServerReplyError
from dapo_megatron.rollout.sglang.colocated_memory import IDLE_WAIT_S
from dapo_megatron.rollout.sglang.engine import SGLangEngine


class Client:
    def __init__(self, url: str, log: list, busy: bool = False) -> None:
        self.base_url, self.log, self.busy = url, log, busy

    def wait_until_idle(self, timeout_s):
        self.log.append((self.base_url, "wait_until_idle", timeout_s))
        if self.busy:
            raise ServerReplyError(f"POST {self.base_url}/flush_cache -> HTTP 400: Timed out waiting for idle state.")

    def release_memory_occupation(self, tags):
        self.log.append((self.base_url, "release", tags))

    def resume_memory_occupation(self, tags):
        self.log.append((self.base_url, "resume", tags))


class Slot:
    def __init__(self, index: int, client: Client) -> None:
        self.index, self.client, self.tp_size, self.same_host, self.process = index, client, 1, True, None
        self.generation, self.available = 0, True


class Transport:
    name = "tensor"

    def close(self, targets):
        pass


class Pool:
    def __init__(self, clients: list[Client]) -> None:
        self.config, self.model_path, self.run_dir = SGLangConfig(transport="tensor"), "model", "run"
        self.device, self.placement = "cpu", "colocated"
        self.slots = [Slot(i, client) for i, client in enumerate(clients)]

    def start(self) -> int:
        return 0

    def capacities(self):
        return [1 for _ in self.slots]

    def available(self):
        return list(self.slots)

    def stop(self) -> None:
        pass


@pytest.fixture
def engine_over():
    engines = []

    def make(clients):
        engines.append(SGLangEngine(Pool(clients), show_progress=False, transport=Transport()))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


def test_each_server_waits_for_idle_before_it_releases(engine_over):
    log = []
    engine = engine_over([Client("a", log), Client("b", log)])
    engine.after_generation()
    assert log == [("a", "wait_until_idle", IDLE_WAIT_S), ("a", "release", ("kv_cache", "cuda_graph")),
                   ("b", "wait_until_idle", IDLE_WAIT_S), ("b", "release", ("kv_cache", "cuda_graph"))]
    log.clear()
    engine.before_generation()  # control: resuming needs no idle server
    assert log == [("a", "resume", ("kv_cache", "cuda_graph")), ("b", "resume", ("kv_cache", "cuda_graph"))]


def test_a_server_still_busy_is_not_released_and_the_error_names_it(engine_over):
    log = []
    engine = engine_over([Client("a", log, busy=True)])
    with pytest.raises(RolloutError, match=r"SGLang server 0 did not become idle within 60 s, so its memory was not "
                                           r"released .*Timed out waiting for idle state"):
        engine.before_policy_update()
    assert ("a", "release", ("weights", "kv_cache", "cuda_graph")) not in log
    assert engine.server_memory(engine.pool.slots[0]).can_generate  # nothing recorded as released
