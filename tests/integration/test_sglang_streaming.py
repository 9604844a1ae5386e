"""Streamed requests on a real SGLang 0.5.23 server (CPU, tiny random Qwen2 with a long context): a partial rollout
across a weight update with per-token versions from the server's ``meta_info.weight_versions``, abort releasing the
server's work round after round, and a server dying under streamed requests (restarted and regenerated, or a clear
error within the timeout)."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file
from tiny_models import TinyQwen2Spec, build_tiny_qwen2, hf_greedy, load_hf_model, perturbed_state_dict, sample_prompts

from dapo_megatron.config import SGLangConfig
from dapo_megatron.rollout.engine import GenerationRequest, RolloutError, SamplingParams
from dapo_megatron.rollout.sglang.engine import SGLangEngine
from dapo_megatron.rollout.sglang.server import require_sglang

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
torch.set_num_threads(1)

SERVER_PYTHON = os.environ.get("DAPO_SGLANG_PYTHON", sys.executable)
REQUEST_TIMEOUT_S = 180.0
LONG = 3000  # tokens: seconds of decoding, so that an update or an abort lands mid-generation


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    try:
        require_sglang(SERVER_PYTHON)
    except RolloutError as error:
        pytest.skip(f"SGLang is not importable by the server python {SERVER_PYTHON}: {error}")
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), TinyQwen2Spec(max_position_embeddings=4096))


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    config = SGLangConfig(python=SERVER_PYTHON, base_port=0, launch_timeout_s=400, request_timeout_s=REQUEST_TIMEOUT_S,
                          max_restarts=1, extra_server_args=["--dtype", "float32", "--max-total-tokens", "32768"])
    engine = SGLangEngine.launch(config, model_path=model_dir, run_dir=tmp_path_factory.mktemp("run"),
                                 show_progress=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(model_dir):
    return sample_prompts(model_dir, 6)


def server_load(engine) -> int:
    """Requests the server runs or queues (``/v1/loads``)."""
    (slot,) = engine.pool.slots
    return sum(int(load["num_running_reqs"]) + int(load["num_waiting_reqs"]) for load in slot.client.loads())


def wait_until(condition, timeout_s: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def poll_all(engine, count: int, timeout_s: float = 300.0) -> dict:
    finished, deadline = [], time.monotonic() + timeout_s
    while len(finished) < count:
        assert time.monotonic() < deadline, f"{len(finished)} of {count} requests came back"
        finished += engine.poll(timeout_s=1.0)
    return {f.request_id: f for f in finished}


@pytest.fixture(params=[0, 2], ids=["reply_in_process", "reply_processes_2"])
def streaming_engine(request, engine, model_dir):
    """The module's engine (``reply_processes: 0``), or a second engine attached to its server with
    ``reply_processes: 2``, which first serves the initial weights again (the test expects them) and afterwards hands
    the server back to the module's engine at a version past its own."""
    if request.param == 0:
        yield engine
        return
    (server,) = engine.server_processes()
    key_file = engine.run_dir / "reply_processes.key"
    key_file.write_text(server.api_key)
    config = SGLangConfig(urls=[server.url], api_key_file=str(key_file), transport="tensor",
                          request_timeout_s=REQUEST_TIMEOUT_S, reply_processes=request.param)
    other = SGLangEngine.launch(config, model_path=engine.model_path, show_progress=False)
    try:
        workers = other.reply_workers.processes
        assert len(workers) == 2 and all(worker.is_alive() for worker in workers)
        other.update_weights([list(load_file(str(model_dir / "model.safetensors")).items())],
                             version=other.weight_version + 1)
        yield other
    finally:
        other.shutdown()
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert not {worker.pid for worker in workers} & {child.pid for child in psutil.Process().children()}
    state = perturbed_state_dict(model_dir, scale=0.1, seed=5)  # what the test leaves served
    engine.update_weights([list(state.items())], version=other.weight_version + 1)


def test_partial_rollout_continues_across_a_weight_update_with_per_token_versions(streaming_engine, model_dir,
                                                                                  prompts):
    """The same partial rollout with the replies parsed in rank 0's threads and in reply processes."""
    engine = streaming_engine
    version = engine.weight_version
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=LONG)
    engine.submit([GenerationRequest("partial", tuple(prompts[0]), params)])
    wait_until(lambda: server_load(engine) > 0, what="the request to run")
    time.sleep(1.0)  # some tokens on the old weights
    state = perturbed_state_dict(model_dir, scale=0.1, seed=5)
    engine.update_weights([list(state.items())], version=version + 1)
    finished = poll_all(engine, 1)["partial"]
    old_model, new_model = load_hf_model(model_dir), load_hf_model(model_dir, state)
    for sample in finished.samples:
        versions, length = sample.token_versions, len(sample.token_ids)
        assert len(versions) == length and version + 1 in versions, "the update landed after the response ended"
        switch = versions.index(version + 1)
        assert 0 < switch and versions == [version] * switch + [version + 1] * (length - switch)
        assert sample.weight_version == version
        prefix = sample.token_ids[:switch]
        assert prefix[:16] == hf_greedy(old_model, prompts[0], 16)[: len(prefix[:16])]
        # the server re-prefilled prompt + prefix with the new weights: the continuation is the new model's
        assert sample.token_ids[switch:switch + 16] == hf_greedy(new_model, prompts[0] + prefix, 16)


def test_abort_releases_the_server_work_round_after_round(engine, prompts):
    loads_after_abort = []
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=LONG, seed=1)
    for round_index in range(3):
        ids = [f"round{round_index}-{i}" for i in range(len(prompts))]
        engine.submit([GenerationRequest(rid, tuple(p), params) for rid, p in zip(ids, prompts)])
        wait_until(lambda: server_load(engine) > 0, what="the requests to run")  # control: there is work to free
        time.sleep(0.5)
        started = time.monotonic()
        engine.abort(ids)
        finished = poll_all(engine, len(ids), timeout_s=60.0)
        print(f"round {round_index}: all {len(ids)} requests back {time.monotonic() - started:.1f} s after abort")
        # a request whose samples all met the model's EOS before the abort finished on its own; every other one
        # must come back aborted, and at least one must (else the abort was never exercised)
        ended_alone = {rid for rid, f in finished.items() if all(s.finish_reason == "stop" for s in f.samples)}
        assert all(f.aborted for rid, f in finished.items() if rid not in ended_alone)
        assert any(f.aborted for f in finished.values()), "every request ended before the abort: nothing to test"
        assert any(f.num_tokens > 0 for f in finished.values()), "running requests return what they generated"
        wait_until(lambda: server_load(engine) == 0, timeout_s=30.0, what="the server to drop aborted requests")
        loads_after_abort.append(server_load(engine))
        assert engine.num_in_flight == 0
    assert loads_after_abort == [0, 0, 0]


def test_an_attached_server_that_stops_answering_fails_the_stream_within_the_timeout(engine, prompts):
    (server,) = engine.server_processes()
    key_file = engine.run_dir / "attached.key"
    key_file.write_text(server.api_key)
    timeout_s = 4.0
    attached = SGLangConfig(urls=[server.url], api_key_file=str(key_file), request_timeout_s=timeout_s)
    other = SGLangEngine.launch(attached, model_path=engine.model_path, show_progress=False)
    try:
        other.submit([GenerationRequest("doomed", tuple(prompts[0]), SamplingParams(n=1, max_new_tokens=LONG))])
        os.killpg(server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RolloutError, match="no SGLang server left"):
                poll_all(other, 1, timeout_s=10 * timeout_s)
            elapsed = time.monotonic() - started
        finally:
            os.killpg(server.pid, signal.SIGCONT)
        assert elapsed < 3 * timeout_s
    finally:
        other.shutdown()
    wait_until(lambda: engine.health().healthy, what="the server to answer again")


def test_a_killed_server_is_restarted_and_streamed_requests_are_regenerated(engine, prompts):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=64, seed=3)
    (server,) = engine.server_processes()
    ids = [f"survive-{i}" for i in range(len(prompts))]
    engine.submit([GenerationRequest(rid, tuple(p), params) for rid, p in zip(ids, prompts)])
    wait_until(lambda: server_load(engine) > 0, what="the requests to run")
    os.killpg(server.pid, signal.SIGKILL)
    finished = poll_all(engine, len(ids), timeout_s=400 + 2 * REQUEST_TIMEOUT_S)
    assert engine.restart_counts() == [1]
    assert not any(f.aborted for f in finished.values())
    assert all(len(s.token_ids) >= 1 and s.token_versions == [engine.weight_version] * len(s.token_ids)
               for f in finished.values() for s in f.samples)
