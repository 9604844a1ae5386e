"""Issue 40, item 6: the SGLang engine counts what it keeps on the servers in samples, the unit a server's
running-request limit counts (rollout/sglang/in_flight.py). Counted in requests of ``rollout.n_samples``, the
one-sample turns of a multi-turn rollout kept 1/n of the servers busy. Checked against a real HTTP server in SGLang's
wire format that records the most samples it held at once (tests/sglang_stub.py)."""

from __future__ import annotations

import threading
import time

import pytest

from dapo_megatron.backend_registry import select_backend
from dapo_megatron.config import load_config
from dapo_megatron.rollout.engine import GenerationRequest, SamplingParams
from dapo_megatron.rollout.factory import build_rollout_engine
from dapo_megatron.rollout.sglang.in_flight import SampleBudget


def trainer_engine(sglang_stub, tmp_path, n_samples: int):
    """The engine as the trainer builds it (rollout/factory.py), attached to the stub, for groups of ``n_samples``."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    config = load_config(None, ["model.source=tiny", "data.source=synthetic", "rollout.engine=sglang",
                                f"rollout.sglang.urls=[{sglang_stub.url}]",
                                f"rollout.n_samples={n_samples}", "rollout.sglang.request_timeout_s=30"])
    return build_rollout_engine(config, model, tmp_path / "run", select_backend())


def streamed(engine, requests: list[GenerationRequest]) -> dict:
    engine.submit(requests)
    finished, deadline = {}, time.monotonic() + 60
    while len(finished) < len(requests) and time.monotonic() < deadline:
        finished.update({f.request_id: f.samples for f in engine.poll(timeout_s=0.5)})
    assert len(finished) == len(requests)
    return finished


def test_one_sample_turns_fill_the_servers_running_limit_and_groups_never_exceed_it(sglang_stub, tmp_path):
    sglang_stub.capacity, sglang_stub.delay_s = 8, 0.3  # the server runs 8 sequences at once; each call takes 0.3 s
    with trainer_engine(sglang_stub, tmp_path, n_samples=4) as engine:
        assert engine.in_flight.limit == 8
        turns = [GenerationRequest(f"turn{i}", (1, 2, 3 + i), SamplingParams(n=1, max_new_tokens=4))
                 for i in range(16)]
        streamed(engine, turns)
        assert sglang_stub.peak_samples_in_flight == 8  # 8 turns at once; counted in requests of 4 samples it was 2
        sglang_stub.peak_samples_in_flight = 0
        groups = [GenerationRequest(f"group{i}", (4, 5, 6 + i), SamplingParams(n=4, max_new_tokens=4))
                  for i in range(5)]
        streamed(engine, groups)
        engine.generate([(7, 8, i + 1) for i in range(5)], SamplingParams(n=4, max_new_tokens=4))
        assert sglang_stub.peak_samples_in_flight == 8  # two groups of 4 at a time, never 3


def test_requests_waiting_for_room_hold_no_thread(sglang_stub, tmp_path):
    sglang_stub.capacity, sglang_stub.delay_s = 8, 1.0
    with trainer_engine(sglang_stub, tmp_path, n_samples=4) as engine:
        engine.submit([GenerationRequest(f"group{i}", (4, 5, 6 + i), SamplingParams(n=4, max_new_tokens=4))
                       for i in range(5)])
        time.sleep(0.5)  # the first two groups are on the server
        sending = [t for t in threading.enumerate() if t.name.startswith("sglang-stream")]
        assert sglang_stub.samples_in_flight == 8 and len(sending) == 2  # not 5: three wait without a thread
        finished, deadline = 0, time.monotonic() + 60
        while finished < 5 and time.monotonic() < deadline:
            finished += len(engine.poll(timeout_s=0.5))
        assert finished == 5


def test_the_budget_admits_in_order_and_lets_an_oversized_request_run_alone():
    budget = SampleBudget(4)
    order, release = [], threading.Event()

    def hold(name: str, samples: int) -> None:
        with budget.taken(samples):
            order.append(name)
            release.wait(10)

    first = threading.Thread(target=hold, args=("three", 3))
    first.start()
    while budget.in_flight != 3:
        time.sleep(0.01)
    waiting = [threading.Thread(target=hold, args=(name, samples)) for name, samples in (("two", 2), ("one", 1))]
    for thread in waiting:
        thread.start()
        time.sleep(0.05)
    assert order == ["three"] and budget.in_flight == 3  # "one" would fit, but it asked after "two": it waits
    release.set()
    for thread in [first, *waiting]:
        thread.join(10)
    assert order == ["three", "two", "one"] and budget.in_flight == 0 and budget.peak == 3
    with budget.taken(9):  # more than the limit: alone
        assert budget.in_flight == 9
        assert not budget.try_take(1)  # who waits without a thread is refused while it does not fit
    told = []
    budget.when_room(lambda: told.append(budget.in_flight))
    assert budget.try_take(3) and not budget.try_take(2)
    budget.give_back(3)
    assert told == [0] and budget.in_flight == 0  # and is told when samples come back
    with pytest.raises(ValueError, match="at least one sample"):
        SampleBudget(0)
