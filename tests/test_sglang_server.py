"""SGLangEngine against a real SGLang 0.5.23 server on a tiny random Qwen2 (CPU).

One server is launched for the whole module (~30-90 s on a 2-core machine); the tensor and distributed transports
are exercised by engines *attached* to that server by URL, and the failure test restarts it once. Skipped with a
reason when SGLang cannot be imported by the server interpreter: ``DAPO_SGLANG_PYTHON`` names it (default: this
interpreter), e.g. ``DAPO_SGLANG_PYTHON=/work/venv_sglang/bin/python`` for a separate SGLang environment.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import psutil
import pytest
import torch
from tiny_models import build_tiny_qwen2, load_hf_model, perturbed_state_dict, sample_prompts

from dapo_megatron.hf_format import bucketed
from dapo_megatron.rollout.engine import RolloutError, SamplingParams
from dapo_megatron.rollout.sglang_client import SGLangClient
from dapo_megatron.config import SGLangConfig
from dapo_megatron.rollout.sglang_engine import SGLangEngine
from dapo_megatron.rollout.sglang_server import require_sglang

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
torch.set_num_threads(1)

SERVER_PYTHON = os.environ.get("DAPO_SGLANG_PYTHON", sys.executable)
REQUEST_TIMEOUT_S = 180.0  # the failure test's re-sent rollout takes ~25 s at ~45 tokens/s on a loaded 2-core box
STARTUP_TIMEOUT_S = 400.0
BUCKET_BYTES = 64 * 1024  # several buckets for the tiny model (its embedding alone is larger)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    try:
        require_sglang(SERVER_PYTHON)
    except RolloutError as error:
        pytest.skip(f"SGLang is not importable by the server python {SERVER_PYTHON} (set DAPO_SGLANG_PYTHON): {error}")
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    # float32 for parity with transformers (SGLang's "auto" may serve an fp32 model in 16 bits)
    config = SGLangConfig(python=SERVER_PYTHON, base_port=0, launch_timeout_s=STARTUP_TIMEOUT_S,
                          request_timeout_s=REQUEST_TIMEOUT_S, max_restarts=1,
                          extra_server_args=["--dtype", "float32", "--max-total-tokens", "4096"])
    engine = SGLangEngine(config, model_path=model_dir,
                          run_dir=tmp_path_factory.mktemp("run"), show_progress=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(model_dir):
    return sample_prompts(model_dir, 4)


def attached(engine: SGLangEngine, transport: str, request_timeout_s: float = REQUEST_TIMEOUT_S) -> SGLangEngine:
    """A second engine on the first one's server (no launch), pushing weights over ``transport``."""
    (server,) = engine.server_processes()
    key_file = engine.run_dir / "attached.key"
    key_file.write_text(server.api_key)
    config = SGLangConfig(urls=[server.url], api_key_file=str(key_file), transport=transport,
                          request_timeout_s=request_timeout_s)
    return SGLangEngine(config, model_path=engine.model_path, show_progress=False)


def hf_greedy(model, prompts, max_new_tokens):
    outputs = []
    for prompt in prompts:
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def engine_greedy(engine, prompts, max_new_tokens):
    samples = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    return [group[0].token_ids for group in samples]


# ---- generation ---------------------------------------------------------------------------------------------------
def test_generate_returns_n_samples_with_logprobs_and_finish_reasons(engine, prompts):
    samples = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=6))
    assert len(samples) == len(prompts)
    for index, group in enumerate(samples):
        assert len(group) == 4
        for sample in group:
            assert sample.prompt_index == index and sample.weight_version == 0
            assert 1 <= len(sample.token_ids) <= 6 and len(sample.logprobs) == len(sample.token_ids)
            assert all(-50 < lp <= 0 for lp in sample.logprobs)
            assert sample.finish_reason == ("length" if len(sample.token_ids) == 6 else "stop")
        assert len({tuple(s.token_ids) for s in group}) > 1, "4 samples at temperature 1 should differ"


def test_stop_token_ends_a_sample_with_reason_stop(engine, prompts):
    first_greedy_token = engine_greedy(engine, prompts[:1], 1)[0][0]
    (group,) = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                           stop_token_ids=(first_greedy_token,)))
    assert group[0].token_ids == [first_greedy_token] and group[0].finish_reason == "stop"


def test_greedy_output_equals_transformers(engine, model_dir, prompts):
    assert engine_greedy(engine, prompts, 16) == hf_greedy(load_hf_model(model_dir), prompts, 16)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_transformers_recomputed_logprobs_at_the_temperature(engine, model_dir, prompts, temperature):
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
    assert engine_greedy(engine, prompts, 12) == hf_greedy(load_hf_model(model_dir, state_dict), prompts, 12)


def test_weight_update_over_disk_serves_the_new_weights(engine, model_dir, prompts):
    before = engine_greedy(engine, prompts, 12)
    state = perturbed_state_dict(model_dir, scale=0.1, seed=11)
    engine.update_weights(bucketed(state.items(), BUCKET_BYTES), version=1)
    _check_serves(engine, model_dir, prompts, state, 1)
    assert engine_greedy(engine, prompts, 12) != before
    snapshots = sorted(p.name for p in (engine.run_dir / "weights").iterdir())
    assert snapshots == ["v1"]


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
    served = SGLangClient(engine.server_urls[0], engine.server_processes()[0].api_key, 30).served_weight_version()
    assert served != str(engine.weight_version), "the attached engines above moved the server past this engine"
    with pytest.raises(RolloutError, match="mismatch"):
        engine.verify_served_version()
    with pytest.raises(RolloutError, match=f"weight_version '{served}'"):
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=2))
    state = perturbed_state_dict(model_dir, scale=0.1, seed=12)
    engine.update_weights([list(state.items())], version=int(served) + 1)
    _check_serves(engine, model_dir, prompts, state, int(served) + 1)


# ---- failures -------------------------------------------------------------------------------------------------------
def test_server_that_stops_answering_raises_within_the_timeout(engine, prompts):
    (server,) = engine.server_processes()
    timeout_s = 4.0
    with attached(engine, "disk", request_timeout_s=timeout_s) as other:
        os.killpg(server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RolloutError, match="no SGLang server left"):
                other.generate(prompts, SamplingParams(n=2, max_new_tokens=4))
            elapsed = time.monotonic() - started
        finally:
            os.killpg(server.pid, signal.SIGCONT)
    assert elapsed < 3 * timeout_s
    assert engine.health().healthy


def test_killed_server_is_restarted_with_its_weights_and_lost_requests_are_resent(engine, model_dir, prompts):
    version = engine.weight_version + 1
    state = perturbed_state_dict(model_dir, scale=0.1, seed=33)
    engine.update_weights([list(state.items())], version=version)
    (server,) = engine.server_processes()
    old_pid = server.pid
    old_tree = [psutil.Process(old_pid)] + psutil.Process(old_pid).children(recursive=True)
    old_shared_memory = {m.path for p in old_tree for m in p.memory_maps() if m.path.startswith("/dev/shm/")}
    prefills_before = server.log_path.read_text().count("Prefill batch")
    result = {}

    def rollout():
        try:
            result["samples"] = engine.generate(prompts * 2, SamplingParams(n=2, max_new_tokens=64))
        except BaseException as error:  # reported to the main thread
            result["error"] = error

    started = time.monotonic()
    worker = threading.Thread(target=rollout)
    worker.start()
    while server.log_path.read_text().count("Prefill batch") == prefills_before and worker.is_alive():
        time.sleep(0.05)
    assert worker.is_alive(), "the rollout finished before the server could be killed mid-rollout"
    os.killpg(old_pid, signal.SIGKILL)  # mid-rollout: requests are in flight
    bound_s = STARTUP_TIMEOUT_S + 2 * REQUEST_TIMEOUT_S + 30
    worker.join(timeout=bound_s)
    elapsed = time.monotonic() - started
    assert not worker.is_alive(), f"generate still running after {bound_s:.0f} s"
    print(f"kill -> restart -> rollout complete in {elapsed:.0f} s")
    assert "error" not in result, result.get("error")
    assert engine.restart_counts() == [1] and server.pid != old_pid
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in old_tree)
    assert old_shared_memory and not [path for path in old_shared_memory if os.path.exists(path)]
    samples = result["samples"]
    assert len(samples) == 2 * len(prompts) and all(len(group) == 2 for group in samples)
    assert all(s.weight_version == version for group in samples for s in group)
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
