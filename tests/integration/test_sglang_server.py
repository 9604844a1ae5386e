"""SGLangEngine against a real SGLang 0.5.23 server on a tiny random Qwen2 (CPU).

The server is the session's (tests/sglang_fixtures.py: launched once, relaunched when a test shut it down); the
tensor and distributed transports are exercised by engines *attached* to it by URL. Every test sets up the weights
it needs, so the tests pass in any order and alone. The failure tests check the README's promise as stated: a
killed or hung server is detected within ``rollout.sglang.request_timeout_s`` (configured small here, compared with
a generous margin, never a tight constant) and restarted serving the weights it had.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch
from sglang_fixtures import (
    REQUEST_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    attached,
    engine_greedy,
    hf_greedy_until_eos,
    initial_weights,
    serve,
    served_version,
)
from tiny_models import load_hf_model, perturbed_state_dict, sample_prompts

from dapo_megatron.hf_format import bucketed
from dapo_megatron.rollout.engine import RolloutError, SamplingParams
from dapo_megatron.rollout.sglang.client import SGLangClient
from dapo_megatron.rollout.sglang.engine import SGLangEngine
from dapo_megatron.rollout.sglang.pool import in_flight_samples, server_capacity

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
torch.set_num_threads(1)

BUCKET_BYTES = 64 * 1024  # several buckets for the tiny model (its embedding alone is larger)
# Scheduling noise on a loaded 2-core machine: added to the configured timeout, never a bound of its own.
MARGIN_S = 30.0


@pytest.fixture
def model_dir(sglang_model_dir):
    return sglang_model_dir


@pytest.fixture
def engine(sglang_server, model_dir) -> SGLangEngine:
    """The session's launched engine, agreeing with its server on the served version (an attached engine of an
    earlier test may have moved the server on: then the initial weights are served again, as a new version)."""
    engine = sglang_server.engine()
    if served_version(engine) != engine.weight_version:
        serve(engine, initial_weights(model_dir))
    return engine


@pytest.fixture(scope="module")
def prompts(sglang_model_dir):
    return sample_prompts(sglang_model_dir, 4)


def _restarts(engine: SGLangEngine) -> int:
    (count,) = engine.restart_counts()
    return count


def _seconds_until_restart(engine: SGLangEngine, restarts_before: int, since: float, worker: threading.Thread,
                           limit_s: float) -> float:
    """Seconds from ``since`` until the pool declared the server failed (its restart count went up)."""
    while _restarts(engine) == restarts_before:
        assert worker.is_alive() or _restarts(engine) > restarts_before, "the rollout ended without a restart"
        assert time.monotonic() - since < limit_s, f"no failure detected within {limit_s:.0f} s"
        time.sleep(0.05)
    return time.monotonic() - since


def _rollout_in_background(engine, prompts, params) -> tuple[threading.Thread, dict]:
    result = {}

    def rollout():
        try:
            result["samples"] = engine.generate(prompts, params)
        except BaseException as error:  # reported to the main thread
            result["error"] = error

    worker = threading.Thread(target=rollout)
    worker.start()
    return worker, result


# ---- generation ---------------------------------------------------------------------------------------------------
def test_requests_in_flight_default_to_what_the_server_runs(engine):
    """rollout.sglang.max_in_flight_samples unset: the server's own running-request limit, read from /server_info
    (issue 26, item 7), not a fixed 64; counted in samples (issue 40, item 6)."""
    (slot,) = engine.pool.slots
    capacity = server_capacity(slot.client.server_info(), slot.client.base_url)
    assert capacity > 64 and engine.config.max_in_flight_samples is None
    assert engine.in_flight.limit == in_flight_samples([capacity]) == capacity


def test_generate_returns_n_samples_with_logprobs_and_finish_reasons(engine, prompts):
    samples = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=6))
    assert len(samples) == len(prompts)
    for index, group in enumerate(samples):
        assert len(group) == 4
        for sample in group:
            assert sample.prompt_index == index and sample.weight_version == engine.weight_version
            assert 1 <= len(sample.token_ids) <= 6 and len(sample.logprobs) == len(sample.token_ids)
            assert all(-50 < lp <= 0 for lp in sample.logprobs)
            if len(sample.token_ids) < 6:
                assert sample.finish_reason == "stop"
            else:  # the 6th token may itself be the end of the text
                assert sample.finish_reason in ("length", "stop")
        assert len({tuple(s.token_ids) for s in group}) > 1, "4 samples at temperature 1 should differ"


def test_stop_token_ends_a_sample_with_reason_stop(engine, prompts):
    first_greedy_token = engine_greedy(engine, prompts[:1], 1)[0][0]
    (group,) = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                           stop_token_ids=(first_greedy_token,)))
    assert group[0].token_ids == [first_greedy_token] and group[0].finish_reason == "stop"


def test_greedy_output_equals_transformers(engine, model_dir, prompts):
    serve(engine, initial_weights(model_dir))
    assert engine_greedy(engine, prompts, 16) == hf_greedy_until_eos(load_hf_model(model_dir), prompts, 16)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_transformers_recomputed_logprobs_at_the_temperature(engine, model_dir, prompts, temperature):
    serve(engine, initial_weights(model_dir))
    samples = engine.generate(prompts, SamplingParams(n=2, temperature=temperature, max_new_tokens=8))
    model = load_hf_model(model_dir)
    max_diff = 0.0
    with torch.no_grad():
        for prompt, group in zip(prompts, samples):
            for sample in group:
                sequence = torch.tensor([prompt + sample.token_ids])
                logits = model(sequence).logits[0, len(prompt) - 1:-1] / temperature
                reference = torch.log_softmax(logits.double(), dim=-1)
                reference = reference.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
                max_diff = max(max_diff, (reference - torch.tensor(sample.logprobs).double()).abs().max().item())
    print(f"max |logprob(SGLang) - logprob(HF)| at T={temperature}: {max_diff:.2e}")
    assert max_diff < 1e-3


def test_requests_without_the_api_key_are_refused(engine, prompts):
    (server,) = engine.server_processes()
    body = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 1}}
    for key in (None, "not-the-key"):
        anonymous = SGLangClient(server.url, key, timeout_s=30)
        assert anonymous.request("POST", "/update_weights_from_disk", {"model_path": "/tmp"})[0] == 401
        assert anonymous.request("POST", "/generate", body)[0] == 401
        assert anonymous.request("POST", "/init_weights_update_group", {})[0] == 401
    assert SGLangClient(server.url, server.api_key, timeout_s=30).request("GET", "/model_info")[0] == 200


# ---- weights --------------------------------------------------------------------------------------------------------
def _check_serves(engine, model_dir, prompts, state_dict, version):
    assert engine.weight_version == version
    assert SGLangClient(engine.server_urls[0], None, 30).request("GET", "/health")[0] == 200
    engine.verify_served_version(version)
    assert engine_greedy(engine, prompts, 12) == hf_greedy_until_eos(load_hf_model(model_dir, state_dict), prompts, 12)


def test_weight_update_over_disk_serves_the_new_weights(engine, model_dir, prompts):
    serve(engine, initial_weights(model_dir))
    before = engine_greedy(engine, prompts, 12)
    state = perturbed_state_dict(model_dir, scale=0.1, seed=11)
    version = engine.weight_version + 1
    engine.update_weights(bucketed(state.items(), BUCKET_BYTES), version=version)
    _check_serves(engine, model_dir, prompts, state, version)
    assert engine_greedy(engine, prompts, 12) != before
    snapshots = sorted(p.name for p in (engine.run_dir / "weights").iterdir())
    assert snapshots == [f"v{version}"]  # the previous snapshot is gone once the new one is served


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_weight_update_over_same_host_transports_serves_the_new_weights(engine, model_dir, prompts, transport):
    with attached(engine, transport) as other:
        version = other.weight_version + 1
        state = perturbed_state_dict(model_dir, scale=0.1, seed=100 + version)
        buckets = list(bucketed(state.items(), BUCKET_BYTES))
        (client,) = [slot.client for slot in other.pool.slots]
        sent = []  # the buckets reach the server as given: one update call per bucket, none re-bucketed
        update_call = getattr(client, f"update_weights_from_{transport}")
        setattr(client, f"update_weights_from_{transport}", lambda *a, **k: (sent.append(1), update_call(*a, **k)))
        started = time.monotonic()
        other.update_weights(iter(buckets), version=version)
        print(f"{transport} update of the tiny model: {time.monotonic() - started:.2f} s")
        assert len(buckets) > 2 and len(sent) == len(buckets)
        _check_serves(other, model_dir, prompts, state, version)
        if transport == "distributed":
            second = perturbed_state_dict(model_dir, scale=0.1, seed=200)
            other.update_weights([list(second.items())], version=version + 1)  # reuses the gloo group
            _check_serves(other, model_dir, prompts, second, version + 1)


def test_served_version_mismatch_is_detected(engine, model_dir, prompts):
    with attached(engine, "tensor") as other:  # another engine moves the server on behind this one's back
        other.update_weights([list(perturbed_state_dict(model_dir, scale=0.1, seed=13).items())],
                             version=other.weight_version + 1)
    served = str(served_version(engine))
    assert served != str(engine.weight_version)
    with pytest.raises(RolloutError, match="mismatch"):
        engine.verify_served_version()
    with pytest.raises(RolloutError, match=f"weight_version '{served}'"):
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=2))
    state = perturbed_state_dict(model_dir, scale=0.1, seed=12)
    engine.update_weights([list(state.items())], version=int(served) + 1)
    _check_serves(engine, model_dir, prompts, state, int(served) + 1)


# ---- failures -------------------------------------------------------------------------------------------------------
def test_attached_server_that_stops_answering_fails_the_rollout_within_the_timeout(engine, prompts):
    """An attached server cannot be restarted: the rollout fails, after the configured timeout and not much more."""
    (server,) = engine.server_processes()
    timeout_s = 8.0
    with attached(engine, "disk", request_timeout_s=timeout_s) as other:
        os.killpg(server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RolloutError, match="no SGLang server left"):
                other.generate(prompts, SamplingParams(n=2, max_new_tokens=4))
            elapsed = time.monotonic() - started
        finally:
            os.killpg(server.pid, signal.SIGCONT)
    print(f"hung attached server: rollout failed after {elapsed:.1f} s (request_timeout_s={timeout_s})")
    assert timeout_s <= elapsed <= timeout_s + MARGIN_S
    assert engine.health().healthy  # SIGCONT: the server itself is fine


def _fail_mid_rollout(engine: SGLangEngine, prompts, failure: signal.Signals, version: int) -> dict:
    """Send ``failure`` to the server's process group while a rollout's requests are in flight; wait for the rollout
    to complete on the restarted server. Returns the seconds from the failure until the pool declared the server
    failed and until the rollout completed, and the /dev/shm files the old server had mapped."""
    (server,) = engine.server_processes()
    old_pid, restarts_before = server.pid, _restarts(engine)
    old_tree = [psutil.Process(old_pid)] + psutil.Process(old_pid).children(recursive=True)
    old_shared_memory = {m.path for p in old_tree for m in p.memory_maps() if m.path.startswith("/dev/shm/")}
    prefills_before = server.log_path.read_text().count("Prefill batch")
    worker, result = _rollout_in_background(engine, prompts, SamplingParams(n=2, max_new_tokens=24))
    while server.log_path.read_text().count("Prefill batch") == prefills_before and worker.is_alive():
        time.sleep(0.05)
    assert worker.is_alive(), "the rollout finished before the server could fail mid-rollout"
    os.killpg(old_pid, failure)
    failed = time.monotonic()
    try:
        detected_s = _seconds_until_restart(engine, restarts_before, failed, worker,
                                            limit_s=REQUEST_TIMEOUT_S + MARGIN_S)
    finally:
        worker.join(timeout=STARTUP_TIMEOUT_S + 2 * REQUEST_TIMEOUT_S)
    completed_s = time.monotonic() - failed
    assert not worker.is_alive(), "generate still running after the restart"
    assert "error" not in result, result.get("error")
    assert _restarts(engine) == restarts_before + 1 and server.pid != old_pid
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in old_tree)
    samples = result["samples"]
    assert len(samples) == len(prompts) and all(len(group) == 2 for group in samples)
    assert all(s.weight_version == version for group in samples for s in group)
    return {"detected_s": detected_s, "completed_s": completed_s, "old_shared_memory": old_shared_memory}


# SIGSTOP: hung — the kernel still accepts connections and holds the requests, nothing answers them, so only the
# timeout tells (counted from when a request was sent, shortly before the stop); SIGKILL: dead — connections are
# refused or reset at once.
@pytest.mark.parametrize("failure, detected_no_earlier_than_s", [("hung", REQUEST_TIMEOUT_S / 2), ("killed", 0.0)])
def test_failed_server_is_detected_within_the_timeout_restarted_with_its_weights_and_lost_requests_resent(
        engine, model_dir, prompts, failure, detected_no_earlier_than_s):
    state = perturbed_state_dict(model_dir, scale=0.1, seed=33)
    version = serve(engine, state)
    signal_sent = {"hung": signal.SIGSTOP, "killed": signal.SIGKILL}[failure]
    outcome = _fail_mid_rollout(engine, prompts * 2, signal_sent, version)
    print(f"{failure} server: detected after {outcome['detected_s']:.1f} s (request_timeout_s={REQUEST_TIMEOUT_S}), "
          f"rollout complete after {outcome['completed_s']:.0f} s")
    assert detected_no_earlier_than_s <= outcome["detected_s"] <= REQUEST_TIMEOUT_S + MARGIN_S
    shared_memory = outcome["old_shared_memory"]
    assert shared_memory and not [path for path in shared_memory if os.path.exists(path)]
    _check_serves(engine, model_dir, prompts, state, version)  # the restart restored version's weights


def test_shutdown_kills_every_server_process_and_is_idempotent(engine):
    (server,) = engine.server_processes()
    tree = [psutil.Process(server.pid)] + psutil.Process(server.pid).children(recursive=True)
    assert len(tree) >= 3  # launcher, scheduler, detokenizer
    shared_memory = {m.path for p in tree for m in p.memory_maps() if m.path.startswith("/dev/shm/")}
    engine.shutdown()
    engine.shutdown()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree)
    assert not [path for path in shared_memory if os.path.exists(path)]
    with pytest.raises(RolloutError, match="shut down"):
        engine.generate([[1, 2]], SamplingParams())
    assert not engine.health().healthy
