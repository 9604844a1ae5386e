"""R3 with tools: a multi-turn trajectory carries the engine's routing of every position the trainer replays — each
turn's sampled tokens as the engine routed them when it sampled them, the tool's answer as the next turn's prefill
routed it (as verl does) — laid out as a single-turn sample's (``[P + R − 1, layers, k]``,
dapo_megatron/policy/rollout_routing.py). Tool output that ends a response, which no turn read, is left to the
trainer's router (UNROUTED). On a tiny Qwen3-MoE warm-started to write the python call (tests/tool_traces.py)."""

from __future__ import annotations

import pytest
import torch
from test_rollout_routing_capture import full_forward_routing
from tool_traces import build_tool_model, tool_trace
from transformers import AutoTokenizer

from dapo_megatron.policy.rollout_routing import UNROUTED, routing_layout
from dapo_megatron.rollout import SamplingParams
from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
from dapo_megatron.rollout.multi_turn import MultiTurnGenerator
from dapo_megatron.rollout.trajectory import UNROUTED as TRAJECTORY_UNROUTED
from dapo_megatron.tools import ToolPool, ToolsConfig


@pytest.fixture(scope="module")
def moe_tool_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tool_model(tmp_path_factory.mktemp("moe_tool"), moe=True)


def generate(model_dir, max_new_tokens: int):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    trace = tool_trace(tokenizer)
    engine = EmbeddedEngine.from_hf_directory(model_dir, return_routed_experts=True)
    tools = ToolsConfig(enabled=True, pool_size=1)
    loop = MultiTurnGenerator(engine, tokenizer, tools, ToolPool(tools))
    try:
        [[sample]] = loop.generate(trace.records(), SamplingParams(
            n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,)))
        return trace, sample, engine.model
    finally:
        loop.close()
        engine.shutdown()


def test_every_turn_s_routing_is_kept_and_tool_output_is_routed_by_the_next_turn(moe_tool_dir):
    trace, sample, model = generate(moe_tool_dir, max_new_tokens=100)
    assert sample.token_ids == trace.response and sample.tool_use.calls == 1 and sample.tool_use.turns == 2
    prompt, response = trace.prompt, sample.token_ids
    routing = routing_layout(sample.routed_experts, prompt_length=len(prompt), response_length=len(response),
                             layers=2, topk=2, where="the multi-turn sample")
    assert routing.shape[0] == len(prompt) + len(response) - 1
    expected = full_forward_routing(model, prompt + response[:-1])  # the same weights route every position alike
    assert torch.equal(routing.sort(-1).values, expected.sort(-1).values)
    # the tool's answer (and the call's last token) came from the second turn's prefill: routed, not left out
    tool_rows = routing[len(prompt) + len(trace.call) - 1:len(prompt) + len(trace.call) + len(trace.output) - 1]
    assert len(tool_rows) == len(trace.output) and (tool_rows != UNROUTED).all()


def test_tool_output_no_turn_read_is_left_to_the_trainer_s_router(moe_tool_dir):
    budget = len(tool_trace(AutoTokenizer.from_pretrained(str(moe_tool_dir))).call) + 3  # cut inside the answer
    trace, sample, model = generate(moe_tool_dir, max_new_tokens=budget)
    assert sample.finish_reason == "length" and sample.token_ids == trace.response[:budget]
    prompt, response = trace.prompt, sample.token_ids
    routing = sample.routed_experts
    assert routing.shape[0] == len(prompt) + len(response) - 1
    read = len(prompt) + len(trace.call) - 1  # the first turn's rows: prompt and the call but its last token
    expected = full_forward_routing(model, prompt + trace.call[:-1])
    assert torch.equal(routing[:read].sort(-1).values, expected.sort(-1).values)
    assert (routing[read:] == UNROUTED).all() and UNROUTED == TRAJECTORY_UNROUTED
