"""Streamed requests on the embedded engine: the same samples as a blocking call, returned as each request is done,
aborted at the next token, and continued across a weight update on the new weights with per-token versions.

Timing is made deterministic with :class:`HoldAtStep`, a weight gate (the engine's own class, passed to its
constructor) that holds the decode loop when it enters a chosen step until the test lets it go."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch
from test_rollout_embedded import (  # noqa: F401 - one_thread is an autouse fixture
    PROMPTS,
    loaded_engine,
    one_thread,
    qwen2_config,
    recomputed_logprobs,
    reference_model,
)
from tiny_models import hf_greedy

from dapo_megatron.config import EmbeddedConfig
from dapo_megatron.rollout.engine import GenerationRequest, SamplingParams
from dapo_megatron.rollout.embedded.weight_gate import WeightGate

WAIT_S = 60.0


class HoldAtStep(WeightGate):
    """Holds the decode loop as it enters gated step number ``hold_at`` (1 = the prompt prefill, t + 2 = decode step
    t) until :attr:`release` is set."""

    def __init__(self, hold_at: int) -> None:
        super().__init__()
        self.entries = 0
        self.hold_at = hold_at
        self.reached = threading.Event()
        self.release = threading.Event()

    @contextmanager
    def step(self):
        self.entries += 1
        if self.entries == self.hold_at:
            self.reached.set()
            assert self.release.wait(WAIT_S), "the test never released the decode loop"
        with super().step():
            yield

    def wait_for_update(self, engine, version: int) -> None:
        """Until the update to ``version`` holds the gate or is done (the held step then runs on the new weights)."""
        deadline = time.monotonic() + WAIT_S
        while not (self.updating or engine.weight_version == version):
            assert time.monotonic() < deadline, "update_weights never reached the gate"
            time.sleep(0.01)


def update_while_held(engine, gate: HoldAtStep, state: dict, version: int) -> None:
    """Push ``state`` as ``version`` while the decode loop is held, then let it go: it continues on the new weights."""
    assert gate.reached.wait(WAIT_S)
    updater = threading.Thread(target=engine.update_weights, args=([list(state.items())], version))
    updater.start()
    gate.wait_for_update(engine, version)
    gate.release.set()
    updater.join(WAIT_S)


def poll_all(engine, count: int):
    finished, deadline = [], time.monotonic() + WAIT_S
    while len(finished) < count:
        assert time.monotonic() < deadline, f"only {len(finished)} of {count} requests came back"
        finished += engine.poll(timeout_s=1.0)
    return {f.request_id: f for f in finished}


def test_streamed_requests_give_the_samples_of_a_blocking_call():
    config = qwen2_config()
    engine = loaded_engine(config, reference_model(config), version=2)
    params = [SamplingParams(n=3, max_new_tokens=9, stop_token_ids=(10, 11), seed=seed) for seed in (1, 2, 3)]
    engine.submit([GenerationRequest(f"r{i}", tuple(p), params[i]) for i, p in enumerate(PROMPTS)])
    finished = poll_all(engine, len(PROMPTS))
    for i, prompt in enumerate(PROMPTS):
        (blocking,) = engine.generate([prompt], params[i])
        streamed = finished[f"r{i}"].samples
        assert [s.token_ids for s in streamed] == [s.token_ids for s in blocking]
        for mine, theirs in zip(streamed, blocking):  # batched with other prompts: equal up to rounding
            assert torch.allclose(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=1e-5)
        assert [s.finish_reason for s in streamed] == [s.finish_reason for s in blocking]
        assert all(s.token_versions == [2] * len(s.token_ids) and s.weight_version == 2 for s in streamed)
    assert engine.num_in_flight == 0
    engine.shutdown()


def test_partial_rollout_continues_on_the_new_weights_with_per_token_versions():
    """Greedy rows paused after 6 tokens take new weights: the rest equals the new model's greedy continuation of
    the same prefix — the prompt and first tokens are re-prefilled by the new weights, not read from the old cache."""
    config = qwen2_config()
    old_model, new_model = reference_model(config, seed=0), reference_model(config, seed=1)
    gate = HoldAtStep(hold_at=2 + 6)
    engine = loaded_engine(config, old_model, version=0, gate=gate)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=20)
    engine.submit([GenerationRequest(f"r{i}", tuple(p), params) for i, p in enumerate(PROMPTS)])
    update_while_held(engine, gate, new_model.state_dict(), 1)
    finished = poll_all(engine, len(PROMPTS))
    for i, prompt in enumerate(PROMPTS):
        (sample,) = finished[f"r{i}"].samples
        assert sample.token_versions == [0] * 6 + [1] * 14 and sample.weight_version == 0
        prefix, rest = sample.token_ids[:6], sample.token_ids[6:]
        assert prefix == hf_greedy(old_model, prompt, 6)
        assert rest == hf_greedy(new_model, prompt + prefix, 14)
        assert rest != hf_greedy(old_model, prompt, 20)[6:], "control: the old weights continue differently"
        reference = recomputed_logprobs(new_model, prompt + prefix, rest, temperature=1.0)  # greedy: T = 1
        assert torch.allclose(torch.tensor(sample.logprobs[6:]), reference, atol=1e-4)
    engine.shutdown()


def test_rows_finished_before_an_update_leave_and_the_others_are_re_prefilled_in_place():
    """A row stops (and leaves the batch) before the update; the remaining rows' re-prefill must use their own
    padding and positions."""
    config = qwen2_config()
    old_model, new_model = reference_model(config, seed=0), reference_model(config, seed=1)
    old_greedy = [hf_greedy(old_model, p, 20) for p in PROMPTS]
    others = old_greedy[0][:6] + old_greedy[2][:6]
    length = next(k + 1 for k, token in enumerate(old_greedy[1][:5]) if token not in old_greedy[1][:k] + others)
    stop = old_greedy[1][length - 1]
    gate = HoldAtStep(hold_at=2 + 6)
    engine = loaded_engine(config, old_model, version=0, gate=gate,
                           settings=EmbeddedConfig(drop_finished_fraction=0.0))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=20, stop_token_ids=(stop,))
    engine.submit([GenerationRequest(f"r{i}", tuple(p), params) for i, p in enumerate(PROMPTS)])
    update_while_held(engine, gate, new_model.state_dict(), 1)
    finished = poll_all(engine, len(PROMPTS))
    (stopped,) = finished["r1"].samples
    assert stopped.token_ids == old_greedy[1][:length] and stopped.token_versions == [0] * length
    for i in (0, 2):
        (sample,) = finished[f"r{i}"].samples
        continuation = hf_greedy(new_model, PROMPTS[i] + old_greedy[i][:6], 14)
        if stop in continuation:
            continuation = continuation[:continuation.index(stop) + 1]
        assert sample.token_ids == old_greedy[i][:6] + continuation
        assert sample.token_versions == [0] * 6 + [1] * len(continuation)
    engine.shutdown()


def test_abort_stops_a_running_request_at_its_next_token_and_a_queued_one_at_once():
    config = qwen2_config()
    gate = HoldAtStep(hold_at=2 + 4)
    engine = loaded_engine(config, reference_model(config), version=0, gate=gate)
    params = SamplingParams(n=2, max_new_tokens=30, seed=7)
    engine.submit([GenerationRequest("running", tuple(PROMPTS[0]), params)])
    assert gate.reached.wait(WAIT_S)
    engine.submit([GenerationRequest("queued", tuple(PROMPTS[1]), params)])  # waits: the worker is busy
    engine.abort(["queued", "unknown"])
    (queued,) = engine.poll(timeout_s=WAIT_S)  # back while the worker is still held
    assert queued.request_id == "queued" and queued.aborted and queued.num_tokens == 0
    engine.abort(["running"])
    gate.release.set()
    running = poll_all(engine, 1)["running"]
    full = engine.generate([PROMPTS[0]], params)[0]
    for sample, reference in zip(running.samples, full):
        assert sample.finish_reason == "abort" and sample.token_ids == reference.token_ids[:4]
    assert engine.num_in_flight == 0
    engine.submit([GenerationRequest("after", tuple(PROMPTS[2]), params)])  # the worker is still serving
    assert not poll_all(engine, 1)["after"].aborted
    engine.shutdown()


def test_a_request_comes_back_as_soon_as_its_samples_are_done():
    config = qwen2_config()
    model = reference_model(config)
    greedy = [hf_greedy(model, p, 25) for p in PROMPTS[:2]]
    # the short request stops at the first token it has not produced before that the long one never produces
    length = next(k + 1 for k, token in enumerate(greedy[0]) if token not in greedy[0][:k] + greedy[1])
    stop = greedy[0][length - 1]
    gate = HoldAtStep(hold_at=2 + 15)
    engine = loaded_engine(config, model, version=0, gate=gate)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=25, stop_token_ids=(stop,))
    engine.submit([GenerationRequest("short", tuple(PROMPTS[0]), params),
                   GenerationRequest("long", tuple(PROMPTS[1]), params)])
    assert gate.reached.wait(WAIT_S)
    (early,) = engine.poll(timeout_s=WAIT_S)  # while the long one is held at its step 15
    assert early.request_id == "short" and early.samples[0].token_ids == greedy[0][:length] and length < 15
    gate.release.set()
    assert poll_all(engine, 1)["long"].samples[0].finish_reason in ("stop", "length")
    engine.shutdown()


def test_shutdown_aborts_what_is_in_flight():
    config = qwen2_config()
    gate = HoldAtStep(hold_at=2 + 3)
    engine = loaded_engine(config, reference_model(config), version=0, gate=gate)
    engine.submit([GenerationRequest("r", tuple(PROMPTS[0]), SamplingParams(n=1, max_new_tokens=40, seed=1))])
    assert gate.reached.wait(WAIT_S)
    stopper = threading.Thread(target=engine.shutdown)
    stopper.start()
    gate.release.set()
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    (finished,) = engine.poll(timeout_s=1.0)
    assert finished.aborted and len(finished.samples[0].token_ids) == 3
