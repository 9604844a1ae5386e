"""Multi-turn tool rollouts against a real SGLang 0.5.23 server (CPU) serving a tiny Qwen2 warm-started to call the
python tool (tests/tool_traces.py): the stop string ends a turn with the call's end kept in ``output_ids``, a turn
continued by input ids is exactly the engine's continuation of the context's ids, and the whole trajectory's ids and
loss mask equal the reference built by hand."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from sglang_fixtures import initial_weights, serve
from tool_traces import CALL_END, build_tool_model, tool_trace
from tiny_models import hf_greedy, load_hf_model
from transformers import AutoTokenizer

from dapo_megatron.rollout.engine import SamplingParams
from dapo_megatron.rollout.multi_turn import MultiTurnGenerator
from dapo_megatron.tools import ToolPool, ToolsConfig

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tool_model_dir(sglang_model_dir, tmp_path_factory):  # noqa: ARG001 - skips with the server's reason
    return build_tool_model(tmp_path_factory.mktemp("tool_model"))


@pytest.fixture
def engine(sglang_server, sglang_model_dir, tool_model_dir):
    engine = sglang_server.engine()
    serve(engine, load_file(str(tool_model_dir / "model.safetensors")))
    yield engine
    serve(engine, initial_weights(sglang_model_dir))  # the next test finds the session's model


def greedy(eos: int, **stops) -> SamplingParams:
    return SamplingParams(n=1, temperature=0.0, max_new_tokens=60, stop_token_ids=(eos,), **stops)


def test_stop_string_ends_the_turn_with_the_call_end_in_output_ids(engine, tool_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tool_model_dir))
    trace = tool_trace(tokenizer)
    end_ids = tuple(tokenizer.encode(CALL_END, add_special_tokens=False))
    [[turn]] = engine.generate([trace.prompt], greedy(tokenizer.eos_token_id, stop_sequences=(end_ids,),
                                                      stop_strings=(CALL_END,)))
    assert turn.token_ids == trace.call and turn.finish_reason == "stop"
    [[control]] = engine.generate([trace.prompt], greedy(tokenizer.eos_token_id))  # no stop string: it writes on
    assert control.token_ids[:len(trace.call)] == trace.call and len(control.token_ids) > len(trace.call)


def test_trajectory_and_continuation_by_input_ids_equal_the_reference(engine, tool_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tool_model_dir))
    trace = tool_trace(tokenizer)
    tools = ToolsConfig(enabled=True, pool_size=2)
    pool = ToolPool(tools)
    try:
        loop = MultiTurnGenerator(engine, tokenizer, tools, pool)
        [[sample]] = loop.generate(trace.records(), greedy(tokenizer.eos_token_id))
    finally:
        pool.close()
    assert sample.token_ids == trace.response and sample.loss_mask == trace.loss_mask
    assert sample.finish_reason == "stop" and sample.tool_use.calls == 1 and sample.tool_use.failed == 0
    # the second turn, sent as input ids: the server's continuation of exactly the context's ids
    context = trace.prompt + trace.call + trace.output
    [[continued]] = engine.generate([context], greedy(tokenizer.eos_token_id))
    assert continued.token_ids == trace.answer == sample.token_ids[len(trace.call) + len(trace.output):]
    reference = hf_greedy(load_hf_model(tool_model_dir), context, 60, stop_at_eos=True)
    assert reference == trace.answer
