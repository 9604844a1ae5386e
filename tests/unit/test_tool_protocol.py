"""Tools as one protocol and calls in two formats (dapo_megatron/tools/tool.py, call_formats.py): every tool the pool
offers is a Tool, arguments are checked against its schema, what the model writes never adds a metric; the fenced and
the Hermes ``<tool_call>`` JSON formats read back what they write and refuse what they cannot read; finding a call's
end decodes a window, not the whole context; a whole Hermes trajectory on the embedded engine equals the reference
built by hand."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import build_tiny_tokenizer
from tool_traces import HERMES_CALL, build_tool_model, tool_trace
from transformers import AutoTokenizer

from dapo_megatron.rollout import SamplingParams
from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
from dapo_megatron.rollout.multi_turn import MultiTurnGenerator
from dapo_megatron.tools import FunctionToolConfig, Tool, ToolPool, ToolsConfig, call_format, tool_counts

ANSWER_TOOL = "def lookup(text, metadata):\n    return 'found ' + text\n"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(0)


def test_every_tool_is_a_tool_and_arguments_are_checked_against_its_schema(tmp_path):
    (tmp_path / "mine.py").write_text(ANSWER_TOOL)
    tools = ToolsConfig(enabled=True, pool_size=2,
                        functions=[FunctionToolConfig(function=f"{tmp_path / 'mine.py'}:lookup", description="Looks")])
    pool = ToolPool(tools)  # the python tool in the bubblewrap sandbox, and ours
    try:
        assert pool.names == ["python", "lookup"]
        assert all(isinstance(tool, Tool) for tool in pool._tools.values())
        assert pool.schemas == tools.schemas()  # the system prompt's {tools} and the tools say the same
        assert pool.call("lookup", "x").text == "found x"  # a text: the tool's one argument
        assert pool.call("lookup", {"text": "y"}).text == "found y"  # a JSON call's arguments
        assert pool.call("python", {"code": "print(6*7)"}).text.strip() == "42"
        for bad, why in (({"txt": "y"}, "missing argument"), ({"text": "y", "k": 1}, "unknown argument"),
                         ({"text": 3}, "must be a string")):
            result = pool.call("lookup", bad)
            assert (result.ok, result.kind) == (False, "refused") and why in result.text
        made_up = pool.call("rm_rf", {"x": "1"})
        assert made_up.kind == "refused" and "no tool named 'rm_rf'" in made_up.text
        counts = pool.counts()
        assert counts["tools/calls"] == 7 and counts["tools/failed/refused"] == 4
        assert counts["tools/lookup/calls"] == 5 and counts["tools/python/calls"] == 1
        assert not any("rm_rf" in key for key in counts)  # a name the model made up adds no metric
    finally:
        pool.close()
    # control: the counts do name a tool that is one of the pool's
    assert "tools/lookup/calls" in tool_counts([], ["lookup"])


def test_each_format_reads_back_the_call_it_writes(tokenizer):
    for fmt in ("fence", "hermes"):
        calls = call_format(ToolsConfig(enabled=True, format=fmt), tokenizer, ["python"])
        text = calls.call_text("python", {"code": "print(6*7)"})
        assert text.endswith(calls.end)
        found = calls.find_call(tokenizer.encode("Let me compute.\n" + text, add_special_tokens=False))
        assert found.name == "python" and found.problem is None
        assert found.arguments in ("print(6*7)", {"code": "print(6*7)"})
    hermes = call_format(ToolsConfig(enabled=True, format="hermes"), tokenizer, ["python"])
    assert hermes.call_text("python", {"code": "print(6*7)"}) == HERMES_CALL


@pytest.mark.parametrize("written, problem", [
    ('<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"\n</tool_call>', "not valid JSON"),
    ('<tool_call>\n["python"]\n</tool_call>', 'a tool call is {"name"'),
    ('<tool_call>\n{"name": "python", "arguments": [1]}\n</tool_call>', "must be a JSON object"),
    ('<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>', None),
])
def test_hermes_calls_the_model_wrote_badly_are_refused_with_the_reason(tokenizer, written, problem):
    calls = call_format(ToolsConfig(enabled=True, format="hermes"), tokenizer, ["python"])
    found = calls.find_call(tokenizer.encode(written, add_special_tokens=False))
    if problem is None:  # arguments written as a JSON string holding the object: read
        assert found.arguments == {"code": "print(1)"} and found.problem is None
    else:
        assert problem in found.problem
    # a closing tag without a call before it is no call: the model goes on
    assert calls.find_call(tokenizer.encode("no call here</tool_call>", add_special_tokens=False)) is None


class CountingTokenizer:
    """The tokenizer, counting the tokens every decode is given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded = 0

    def encode(self, *args, **kwargs):
        return self.tokenizer.encode(*args, **kwargs)

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("fmt", ["fence", "hermes"])
def test_finding_a_call_end_decodes_a_window_whatever_the_prompt_length(tokenizer, fmt):
    counting = CountingTokenizer(tokenizer)
    calls = call_format(ToolsConfig(enabled=True, format=fmt), counting, ["python"])
    turn = tokenizer.encode("Compute it first. " + calls.call_text("python", {"code": "print(6*7)"}) + "Answer: 42",
                            add_special_tokens=False)
    expected = len(tokenizer.encode("Compute it first. " + calls.call_text("python", {"code": "print(6*7)"}),
                                    add_special_tokens=False))
    decoded = {}
    for words in (5, 2000):
        before = tokenizer.encode("What is 6*7? " * words, add_special_tokens=False)
        counting.decoded = 0
        assert calls.call_end_length(before, turn) == expected
        decoded[words] = counting.decoded
    # ~log2(len(turn)) decodes of a window of the context and the turn: the cost does not grow with the prompt
    window = 2 * (len(calls.end_ids) + 1) + len(calls.end)
    assert decoded[5] == decoded[2000] <= (window + len(turn)) * (math.ceil(math.log2(len(turn))) + 3)
    assert decoded[2000] < len(before)  # control: less than one decode of the context alone


def test_a_hermes_trajectory_on_the_embedded_engine_equals_the_reference(tmp_path):
    torch.set_num_threads(1)
    model_dir = build_tool_model(tmp_path / "hermes", fmt="hermes")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    trace = tool_trace(tokenizer, fmt="hermes")
    engine = EmbeddedEngine.from_hf_directory(model_dir)
    tools = ToolsConfig(enabled=True, format="hermes", pool_size=1)
    loop = MultiTurnGenerator(engine, tokenizer, tools, ToolPool(tools))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=200, stop_token_ids=(tokenizer.eos_token_id,))
    try:
        [[sample]] = loop.generate(trace.records(), params)
        # control: the fenced format does not read this model's calls; its response ends without a tool's answer
        fenced = MultiTurnGenerator(engine, tokenizer, ToolsConfig(enabled=True), ToolPool(ToolsConfig(enabled=True)))
        [[plain]] = fenced.generate(trace.records(), params)
        fenced.close()
    finally:
        loop.close()
        engine.shutdown()
    assert sample.token_ids == trace.response and sample.loss_mask == trace.loss_mask
    assert (sample.tool_use.calls, sample.tool_use.failed, sample.finish_reason) == (1, 0, "stop")
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(sample.token_ids)
    assert plain.tool_use.calls == 0 and "<tool_response>" not in tokenizer.decode(plain.token_ids)
