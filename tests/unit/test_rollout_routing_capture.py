"""The embedded engine's record of its MoE routing (rollout/embedded/routing_capture.py), in SGLang's layout: the
top-k expert ids of the prompt and of every response token but the last, per layer, int16."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_random_hf_model
from tiny_qwen3 import tiny_qwen3_moe_config

from dapo_megatron.rollout import SamplingParams
from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
from dapo_megatron.rollout.embedded.routing_capture import RoutingCapture, moe_gates


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("moe") / "hf"
    save_random_hf_model(directory, tiny_qwen3_moe_config(num_experts=5, topk=2, num_layers=3), seed=2)
    return directory


def full_forward_routing(model, ids: list[int]) -> torch.Tensor:
    """The model's own routing of ``ids`` in one plain forward: ``[len(ids), layers, k]``."""
    capture = RoutingCapture(model)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
        return capture.take(1, len(ids))[0]
    finally:
        capture.close()


def test_each_sample_carries_the_routing_of_its_prompt_and_all_response_tokens_but_the_last(moe_dir):
    engine = EmbeddedEngine.from_hf_directory(moe_dir, return_routed_experts=True)
    prompts = [[5, 6, 7, 8, 9], [11, 3], [5, 6, 7, 8, 9]]  # prompts of different lengths: left padding
    samples = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3,
                                                      stop_token_ids=(4,)))
    checked = 0
    for prompt, group in zip(prompts, samples):
        for sample in group:
            routing = sample.routed_experts
            assert routing.dtype == torch.int16
            assert tuple(routing.shape) == (len(prompt) + len(sample.token_ids) - 1, 3, 2)
            expected = full_forward_routing(engine.model, prompt + sample.token_ids[:-1])
            assert torch.equal(routing.sort(-1).values, expected.sort(-1).values)
            checked += 1
    assert checked == 6
    # control: the engine built without the switch records nothing, and a dense model has no routers to capture
    engine = EmbeddedEngine.from_hf_directory(moe_dir)
    plain = engine.generate(prompts[:1], SamplingParams(n=1, max_new_tokens=3, seed=3))
    assert plain[0][0].routed_experts is None


def test_a_dense_model_has_no_routing_to_capture(tmp_path):
    from tiny_qwen3 import tiny_qwen3_config
    model = save_random_hf_model(tmp_path / "dense", tiny_qwen3_config(num_layers=2), seed=1)
    assert moe_gates(model) == []
    with pytest.raises(ValueError, match="mixture-of-experts"):
        RoutingCapture(model)


def test_two_threads_forwarding_the_same_model_each_take_their_own_routing(moe_dir):
    """Async mode: validation's generate and the streaming thread run forwards of one model at once (the failure
    this guards: a hook of one thread's forward overwrote the other's, "stack expects each tensor to be equal
    size"). Thread A forwards, thread B forwards and takes, then A takes: A must get its own tokens' routing."""
    import threading

    engine = EmbeddedEngine.from_hf_directory(moe_dir)
    model = engine.model
    long_ids, short_ids = list(range(5, 17)), [7, 8, 9]
    expected_long, expected_short = full_forward_routing(model, long_ids), full_forward_routing(model, short_ids)
    capture = RoutingCapture(model)
    a_forwarded, b_done = threading.Event(), threading.Event()
    taken = {}

    def thread_a():
        with torch.no_grad():
            model(input_ids=torch.tensor([long_ids]))
        a_forwarded.set()
        b_done.wait(timeout=60)
        taken["a"] = capture.take(1, len(long_ids))[0]

    def thread_b():
        a_forwarded.wait(timeout=60)
        with torch.no_grad():
            model(input_ids=torch.tensor([short_ids]))
        taken["b"] = capture.take(1, len(short_ids))[0]
        b_done.set()

    try:
        threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        capture.close()
    assert torch.equal(taken["a"].sort(-1).values, expected_long.sort(-1).values)
    assert torch.equal(taken["b"].sort(-1).values, expected_short.sort(-1).values)


def test_the_run_s_engine_records_routing_from_when_it_is_built(moe_dir, tmp_path):
    """R3 is an option the engine is built with (rollout/factory.py), read-only afterwards."""
    from dapo_megatron.backend_registry import select_backend
    from dapo_megatron.config import load_config
    from dapo_megatron.rollout.factory import build_rollout_engine

    minimal = ["model.source=tiny", "model.tiny.arch=qwen3_moe", "data.source=synthetic", "rollout.engine=embedded"]
    backend = select_backend()
    for replay, recorded in (("replay_rollout", True), ("replay_old", False), ("none", False)):
        config = load_config(None, [*minimal, f"algorithm.moe_routing_replay={replay}"])
        engine = build_rollout_engine(config, moe_dir, tmp_path, backend)
        assert engine.return_routed_experts is recorded
        with pytest.raises(AttributeError):
            engine.return_routed_experts = not recorded
        engine.shutdown()
