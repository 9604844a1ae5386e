"""Multi-turn tool rollouts on the real embedded engine and the real python sandbox: token ids and loss mask equal a
reference built by hand, the turn and budget limits, the call's end found whatever the engine matched."""

from __future__ import annotations

import pytest
import torch
from tool_traces import CALL_END, CODE, tool_trace, build_tool_model
from transformers import AutoTokenizer

from dapo_megatron.rollout import SamplingParams
from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
from dapo_megatron.rollout.multi_turn import MultiTurnGenerator
from dapo_megatron.tools import ToolPool, ToolsConfig, call_format


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tool_model(tmp_path_factory.mktemp("tool_model"))


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = EmbeddedEngine.from_hf_directory(model_dir, version=2)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


def rollout(engine, tokenizer, **settings) -> tuple[MultiTurnGenerator, ToolPool]:
    tools = ToolsConfig(enabled=True, pool_size=2, **settings)
    pool = ToolPool(tools)
    return MultiTurnGenerator(engine, tokenizer, tools, pool), pool


def greedy(eos: int, max_new_tokens: int = 100) -> SamplingParams:
    return SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=(eos,))


def test_trajectory_equals_the_reference_built_by_hand(engine, tokenizer):
    trace = tool_trace(tokenizer)
    loop, pool = rollout(engine, tokenizer)
    try:
        [[sample]] = loop.generate(trace.records(), greedy(tokenizer.eos_token_id))
    finally:
        pool.close()
    assert sample.token_ids == trace.response
    assert sample.loss_mask == trace.loss_mask
    assert sample.finish_reason == "stop"
    assert (sample.tool_use.turns, sample.tool_use.calls, sample.tool_use.failed) == (2, 1, 0)
    assert sample.tool_use.output_tokens == len(trace.output)
    assert pool.counts()["tools/python/calls"] == 1
    # tool tokens: log-prob 0.0 and the version of the turn before; sampled tokens: the engine's own, unchanged
    tool = [i for i, m in enumerate(sample.loss_mask) if m == 0]
    assert [sample.logprobs[i] for i in tool] == [0.0] * len(tool)
    assert sample.token_versions == [2] * len(sample.token_ids) and sample.weight_version == 2
    # token in, token out: each turn is exactly what the engine samples from the context as ids
    [[first]] = engine.generate([trace.prompt], greedy(tokenizer.eos_token_id, len(trace.call)))
    [[second]] = engine.generate([trace.prompt + trace.call + trace.output], greedy(tokenizer.eos_token_id))
    assert first.token_ids == trace.call and second.token_ids == trace.answer
    assert sample.logprobs[:len(trace.call)] == first.logprobs
    assert sample.logprobs[len(trace.call) + len(trace.output):] == second.logprobs


def test_the_call_ending_the_last_turn_is_not_run(engine, tokenizer):
    trace = tool_trace(tokenizer)
    loop, pool = rollout(engine, tokenizer, max_turns=1)
    try:
        [[sample]] = loop.generate(trace.records(), greedy(tokenizer.eos_token_id))
    finally:
        pool.close()
    assert sample.token_ids == trace.call and sample.loss_mask == [1] * len(trace.call)
    assert sample.finish_reason == "stop" and sample.tool_use.calls == 0
    assert pool.counts()["tools/calls"] == 0


def test_tool_output_is_capped_and_counts_in_the_budget(engine, tokenizer):
    capped = tool_trace(tokenizer, output_text="42", max_output_tokens=1)
    assert len(capped.output) < len(tool_trace(tokenizer).output)  # the cap cuts something
    budget = len(capped.call) + len(capped.output) - 2  # the answer block does not fit
    loop, pool = rollout(engine, tokenizer, max_tool_output_tokens=1)
    try:
        [[sample]] = loop.generate(capped.records(), greedy(tokenizer.eos_token_id, max_new_tokens=budget))
    finally:
        pool.close()
    assert sample.token_ids == (capped.call + capped.output)[:budget]
    assert sample.loss_mask == capped.loss_mask[:budget]
    assert sample.finish_reason == "length" and len(sample.token_ids) == budget


def test_sampled_trajectories_replay_with_their_seed(engine, tokenizer):
    trace = tool_trace(tokenizer)
    loop, pool = rollout(engine, tokenizer)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=100, stop_token_ids=(tokenizer.eos_token_id,),
                            seed=11)
    try:
        first = loop.generate(trace.records(2), params)
        again = loop.generate(trace.records(2), params)
    finally:
        pool.close()
    assert [[s.token_ids for s in group] for group in first] == [[s.token_ids for s in group] for group in again]
    for sample in [s for group in first for s in group]:
        assert len(sample.loss_mask) == len(sample.token_ids) == len(sample.logprobs) == len(sample.token_versions)
        assert sample.tool_use.output_tokens == sample.loss_mask.count(0)


def test_call_end_found_in_a_turn_the_engine_did_not_stop(tokenizer):
    """An engine that matched another tokenization of the end (or none) overshoots; the turn is cut after the
    first token that completes the call's end, and the block's tool and code are read from the segment."""
    trace = tool_trace(tokenizer)
    calls = call_format(ToolsConfig(), tokenizer, ["python"])
    overshoot = trace.call + tokenizer.encode("Answer", add_special_tokens=False)
    assert calls.call_end_length(trace.prompt, overshoot) == len(trace.call)
    assert calls.call_end_length(trace.prompt, trace.call[:-1]) is None  # control: end not complete
    found = calls.find_call(trace.prompt + trace.call)
    assert (found.name, found.arguments) == ("python", CODE)
    # a closed block that names no tool is no call
    text_block = tokenizer.encode("```text\nhello" + CALL_END, add_special_tokens=False)
    assert calls.find_call(text_block) is None


def test_embedded_engine_stops_at_a_stop_sequence(engine, tokenizer):
    trace = tool_trace(tokenizer)
    end_ids = tuple(tokenizer.encode(CALL_END, add_special_tokens=False))
    plain = greedy(tokenizer.eos_token_id)
    [[stopped]] = engine.generate([trace.prompt], SamplingParams(**{**vars(plain), "stop_sequences": (end_ids,)}))
    assert stopped.token_ids == trace.call and stopped.finish_reason == "stop"
    [[control]] = engine.generate([trace.prompt], plain)  # without it the model writes on past the call
    assert control.token_ids[:len(trace.call)] == trace.call and len(control.token_ids) > len(trace.call)


def test_sglang_payload_carries_stop_strings_only_when_set():
    from dapo_megatron.rollout.sglang.requests import build_generate_payload

    plain = SamplingParams(n=2, max_new_tokens=8, stop_token_ids=(3,))
    assert "stop" not in build_generate_payload([1, 2], 0, plain, seeded=False)["sampling_params"]
    with_stop = SamplingParams(**{**vars(plain), "stop_sequences": ((5, 6),), "stop_strings": (CALL_END,)})
    payload = build_generate_payload([1, 2], 0, with_stop, seeded=False)
    assert payload["sampling_params"]["stop"] == [CALL_END] and payload["input_ids"] == [[1, 2]]
    with pytest.raises(ValueError, match="stop_strings"):  # ids alone: SGLang cannot match them
        build_generate_payload([1, 2], 0, SamplingParams(stop_sequences=((5, 6),)), seeded=False)


def test_sync_collector_generates_multi_turn_groups_when_tools_are_on(model_dir, engine, tokenizer):
    from pathlib import Path

    from dapo_megatron.collectors.sync import RolloutCollector
    from dapo_megatron.config import load_config
    from dapo_megatron.data.prompts import PromptRecord
    from dapo_megatron.data.sampler import PromptSampler
    from dapo_megatron.reward.scorer import RewardScorer
    from dapo_megatron.rollout.factory import build_rollout_generator

    trace = tool_trace(tokenizer)
    records = [PromptRecord(prompt_ids=tuple(trace.prompt), ground_truth="42", data_source="math_dapo", index=i,
                            text="") for i in range(4)]
    tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"

    def collect(*overrides):
        config = load_config(tiny, ["rollout.n_samples=2", "rollout.max_response_length=40",
                                    "trainer.train_batch_size=2", "trainer.mini_batch_size=1",
                                    "algorithm.dynamic_sampling=false", "algorithm.overlong_buffer_len=4",
                                    "rollout.temperature=0.3", *overrides])
        reward = RewardScorer(config)
        collector = RolloutCollector(build_rollout_generator(config.rollout, engine, tokenizer),
                                     PromptSampler(records, batch_size=2, seed=0), tokenizer, config, reward)
        try:
            return [collector.collect(step=step) for step in range(2)]
        finally:
            collector.close()
            reward.close()

    (groups, metrics), (_, second) = collect("rollout.tools.enabled=true")
    assert second["tools/calls"] == 4  # the step's calls, not the pool's total
    for group in groups:
        assert [list(m) for m in group.loss_masks] == [trace.loss_mask] * 2
        assert [list(r) for r in group.responses] == [trace.response] * 2 and group.accs == [True, True]
    assert metrics["tools/calls"] == 4 and metrics["num_turns/mean"] == 2.0 and metrics["timing_s/tool_calls"] > 0
    assert "tools/wall_s" not in metrics  # a clock reading: logged as one
    assert metrics["tools/acc/with_tool"] == 1.0 and metrics["tools/calls_per_response"] == 1.0
    assert metrics["response_length/mean"] == len(trace.call) + len(trace.answer)
    # control: tools off, the same prompts get single-turn responses and no tool numbers
    [(groups, metrics), _] = collect()
    assert all(group.loss_masks is None for group in groups) and "num_turns/mean" not in metrics
    assert all(len(r) > len(trace.call) for group in groups for r in group.responses)


SLOW_TOOL = '''
import os, time

def python(text, metadata):
    start = time.time()
    time.sleep(1.5)
    with open(os.path.join(os.environ["TOOL_TIMES_DIR"], f"{os.getpid()}.txt"), "w") as out:
        out.write(f"{start} {time.time()}")
    return "42"
'''


@pytest.mark.parametrize("pool_size", [4, 1])
def test_tool_calls_of_many_trajectories_run_at_once(engine, tokenizer, tmp_path, monkeypatch, pool_size):
    """Four trajectories reach their call together: with a pool of 4 the calls overlap in time; the control, a pool
    of 1, runs them one after the other (the pool bounds them, and the loop never waits for one call alone)."""
    (tmp_path / "slow_tool.py").write_text(SLOW_TOOL)
    monkeypatch.setenv("TOOL_TIMES_DIR", str(tmp_path))
    from dapo_megatron.tools import FunctionToolConfig

    tools = ToolsConfig(enabled=True, code=False, pool_size=pool_size,
                        functions=[FunctionToolConfig(function=f"{tmp_path / 'slow_tool.py'}:python")])
    pool = ToolPool(tools)
    trace = tool_trace(tokenizer)
    try:
        loop = MultiTurnGenerator(engine, tokenizer, tools, pool)
        groups = loop.generate(trace.records(), SamplingParams(**{**vars(greedy(tokenizer.eos_token_id)), "n": 4}))
    finally:
        pool.close()
    assert [s.token_ids for s in groups[0]] == [trace.response] * 4
    spans = sorted(tuple(map(float, path.read_text().split())) for path in tmp_path.glob("*.txt"))
    assert len(spans) == 4
    overlapping = sum(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))
    # all four overlap unless the machine stalls a process start past the sleep; one overlap shows the concurrency
    assert overlapping >= 1 if pool_size == 4 else overlapping == 0
