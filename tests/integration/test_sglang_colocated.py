"""Colocated placement's turns against the real SGLang 0.5.23 server on CPU: generate → release (KV cache, then
weights) → update → resume weights → new weights → resume KV cache → generate, as an engine attached with
``placement="colocated"`` sends them.

What the CPU server can show: that it accepts every request of the sequence, in this order, and stays healthy (it
dies when asked to resume memory it holds: the last test shows it, the control for "healthy"); which requests it
received and in which order (its access log); that the KV-cache release reached its scheduler (it flushes the cache
then, and does not for the weights' release); that after the turns it serves the new weights (greedy output equal
to transformers with them). What only a GPU shows: the memory actually freed and mapped again (the CPU server has no
memory saver, so release and resume change nothing there) and the new weights arriving by CUDA IPC into resumed
memory (README, Scale section)."""

from __future__ import annotations

import re
import time

import pytest
import torch
from sglang_fixtures import engine_greedy, hf_greedy_until_eos, initial_weights, serve, served_version
from tiny_models import load_hf_model, perturbed_state_dict, sample_prompts

from dapo_megatron.config import SGLangConfig
from dapo_megatron.rollout.placement import ServerMemory, ServerMemoryError
from dapo_megatron.rollout.sglang.client import SGLangClient, SGLangServerError
from dapo_megatron.rollout.sglang.engine import SGLangEngine

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
torch.set_num_threads(1)

MEMORY_AND_WEIGHT_CALLS = re.compile(r'"POST /(generate|release_memory_occupation|resume_memory_occupation|'
                                     r'update_weights_from_tensor) HTTP')


def _colocated_engine(launched: SGLangEngine) -> SGLangEngine:
    """An engine attached to the session's server with colocated placement, pushing weights over the tensor
    transport (CUDA IPC handles on a GPU; on CPU the same endpoint with shared-memory tensors)."""
    (server,) = launched.server_processes()
    key_file = launched.run_dir / "colocated.key"
    key_file.write_text(server.api_key)
    config = SGLangConfig(urls=[server.url], api_key_file=str(key_file), transport="tensor", request_timeout_s=60)
    return SGLangEngine.launch(config, model_path=launched.model_path, show_progress=False, placement="colocated")


def _log_from(path, offset: int) -> str:
    with open(path, errors="replace") as handle:
        handle.seek(offset)
        return handle.read()


def test_one_step_of_turns_on_the_real_server(sglang_server, sglang_model_dir):
    launched = sglang_server.engine()
    if served_version(launched) != launched.weight_version:
        serve(launched, initial_weights(sglang_model_dir))
    (server,) = launched.server_processes()
    prompts = sample_prompts(sglang_model_dir, 3)
    new_state = perturbed_state_dict(sglang_model_dir, scale=0.1, seed=77)
    with _colocated_engine(launched) as engine:
        (slot,) = engine.pool.slots
        log_start = server.log_path.stat().st_size

        engine.before_generation()  # a server that released nothing: nothing to resume, nothing sent
        before = engine_greedy(engine, prompts, 10)
        engine.after_generation()
        assert engine.server_memory(slot) == ServerMemory(frozenset({"kv_cache", "cuda_graph"}))
        with pytest.raises(ServerMemoryError, match="gave their memory to the trainer"):
            engine_greedy(engine, prompts, 10)  # refused here, never sent
        engine.before_policy_update()
        with pytest.raises(ServerMemoryError, match="no weights were pushed since"):
            engine.before_generation()
        version = engine.weight_version + 1
        engine.update_weights([list(new_state.items())], version=version)
        assert engine.server_memory(slot) == ServerMemory(frozenset({"kv_cache", "cuda_graph"}))
        engine.before_generation()
        assert engine.server_memory(slot) == ServerMemory()
        after = engine_greedy(engine, prompts, 10)

        assert after == hf_greedy_until_eos(load_hf_model(sglang_model_dir, new_state), prompts, 10)
        assert after != before  # the control: the new weights are what changed the output
        engine.verify_served_version(version)
        assert engine.health().healthy
        log = _log_from(server.log_path, log_start)

    received = MEMORY_AND_WEIGHT_CALLS.findall(log)
    assert received == ["generate"] * len(prompts) + [
        "release_memory_occupation",  # kv_cache + cuda_graph, after generating
        "release_memory_occupation",  # weights, before the policy update
        "resume_memory_occupation",  # weights, before the new ones are pushed
        "update_weights_from_tensor",
        "resume_memory_occupation",  # kv_cache + cuda_graph, before generating
    ] + ["generate"] * len(prompts)
    # Each release came after the engine waited for an idle scheduler (/flush_cache?timeout=, which flushes the
    # cache once idle, then answers); the first release also named the KV cache (the scheduler flushes it again
    # before answering), the second only the weights (no flush of its own): the tags reached the scheduler.
    releases = [m.start() for m in re.finditer(r'"POST /release_memory_occupation', log)]
    waits = [m.start() for m in re.finditer(r'"POST /flush_cache\?timeout=', log)]
    flushes = [m.start() for m in re.finditer(r"Cache flushed successfully", log)]
    assert len(releases) == 2 and len(waits) == 2
    for wait, release in zip(waits, releases):
        assert wait < release and not any(wait < other < release for other in releases)
    assert [any(wait < f < release for f in flushes) for wait, release in zip(waits, releases)] == [True, False]


def test_resuming_memory_a_server_holds_kills_it(sglang_server):
    """The control of the test above: the wrong move the engine's bookkeeping prevents ends the server, so that
    test's healthy server after the sequence means every resume named released memory. (The session's server is
    relaunched for the next test that needs it.)"""
    launched = sglang_server.engine()
    (server,) = launched.server_processes()
    client = SGLangClient(server.url, server.api_key, timeout_s=30)
    client.release_memory_occupation(("kv_cache",))
    client.resume_memory_occupation(("kv_cache",))  # released first: accepted
    assert launched.health().healthy
    try:
        client.resume_memory_occupation(("kv_cache",))  # held: SGLang's scheduler fails on it
    except SGLangServerError:  # the connection may close before an answer; what matters is below
        pass
    deadline = time.monotonic() + 120
    while launched.health().healthy and time.monotonic() < deadline:
        time.sleep(1)
    assert not launched.health().healthy
    assert "KeyError: 'kv_cache'" in _log_from(server.log_path, 0)
