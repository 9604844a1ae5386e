"""A system prompt for tool runs (``rollout.tools.system_prompt``, ``{tools}`` filled from the tools' schemas) on
every prompt, and the warm-start from your own multi-turn traces file (``warm_start.traces``,
dapo_megatron/tiny_model/traces.py): the traces become exactly the token ids and loss mask the built-in tool traces
make, a bad line is refused with the file, the line and what is wrong, and a warm-start runs on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo_megatron.config import ConfigError, TinyModelConfig, load_config
from dapo_megatron.data.prompts import build_prompt_records, prompt_messages
from dapo_megatron.data.schema import validate_row
from dapo_megatron.data.synthetic_tools import make_tool_split, tool_trace
from dapo_megatron.data.task import eval_prompts
from dapo_megatron.data.tokenizer import SYSTEM_TOKEN, build_tiny_tokenizer
from dapo_megatron.tiny_model import tiny_qwen2_config
from dapo_megatron.tiny_model.traces import read_traces, trace_example
from dapo_megatron.tiny_model.warm_start import tool_trace_examples, warm_start_on_synthetic_task
from dapo_megatron.tools import ToolsConfig, call_format
from dapo_megatron.user_errors import DataError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu_tools.yaml"
SYSTEM = "Use a tool when it helps. Tools:\n{tools}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_the_system_prompt_lists_the_tools_and_starts_every_prompt(tokenizer):
    tools = ToolsConfig(enabled=True, system_prompt=SYSTEM)
    text = tools.system_text()
    listed = [json.loads(line) for line in text.splitlines()[1:]]
    assert listed == [{"type": "function", "function": tools.schemas()[0]}]
    assert listed[0]["function"]["name"] == "python" and listed[0]["function"]["parameters"]["required"] == ["code"]
    config = load_config(EXAMPLE, ["data.synthetic.num_train=20", "data.synthetic.num_heldout=3",
                                   "data.max_prompt_length=512", f"rollout.tools.system_prompt={json.dumps(SYSTEM)}"])
    records = eval_prompts(config, tokenizer)
    assert len(records) == 3 and all(r.text.startswith(SYSTEM_TOKEN + "Use a tool") for r in records)
    # control: no system prompt, or tools off, no system message
    plain = eval_prompts(load_config(EXAMPLE, ["data.synthetic.num_heldout=3"]), tokenizer)
    assert plain[0].text.startswith("<|user|>")
    assert ToolsConfig(enabled=False, system_prompt=SYSTEM).system_text() is None
    # a row with a system message of its own keeps it
    row = validate_row({"data_source": "t", "prompt": [{"role": "system", "content": "mine"},
                                                       {"role": "user", "content": "q"}],
                        "reward_model": {"ground_truth": "1"}}, source="t", row=0, integer_answers=True)
    assert prompt_messages(row, "other")[0] == {"role": "system", "content": "mine"}
    for bad in ("  ", "{tools}{tools}"):
        with pytest.raises(ConfigError, match="^rollout.tools.system_prompt: "):
            ToolsConfig(system_prompt=bad).validate()


def write_traces(path: Path, problems, calls, tool: str = "python") -> Path:
    lines = []
    for problem in problems:
        trace = tool_trace(problem)
        call = calls.call_text(tool, {"code": trace.code})
        lines.append(json.dumps({"prompt": [{"role": "user", "content": problem.prompt_text}],
                                 "reward_model": {"ground_truth": str(problem.answer)},
                                 "response": [{"role": "assistant", "content": call},
                                              {"role": "tool", "content": trace.output},
                                              {"role": "assistant", "content": trace.answer_line}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_traces_become_the_tokens_and_mask_of_the_built_in_tool_traces(tokenizer, tmp_path):
    problems = make_tool_split(0, 4, 0).train
    calls = call_format(ToolsConfig(enabled=True), tokenizer, ["python"])
    traces = read_traces(write_traces(tmp_path / "traces.jsonl", problems, calls), tokenizer, max_prompt_length=64,
                         system_prompt=None, calls=calls)
    rows = [validate_row(p.to_row(i, "train"), source="t", row=i, integer_answers=True) for i, p in enumerate(problems)]
    records = build_prompt_records(rows, tokenizer, max_prompt_length=64).records
    assert [trace_example(t, tokenizer, calls) for t in traces] == tool_trace_examples(records, problems, tokenizer,
                                                                                        calls, "python")
    assert [t.record.ground_truth for t in traces] == [str(p.answer) for p in problems]


@pytest.mark.parametrize("line, problem", [
    ("{not json", "line 2: not JSON"),
    ('{"prompt": [{"role": "user", "content": "q"}], "response": [{"role": "assistant", "content": "a"}]}',
     "line 2: .*reward_model"),
    ('{"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "1"}, '
     '"response": [{"role": "assistant", "content": "no call here"}, {"role": "tool", "content": "1"}, '
     '{"role": "assistant", "content": "Answer: 1"}]}', r"line 2: response\[0\] is followed by a tool's answer"),
    ('{"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "1"}, '
     '"response": [{"role": "assistant", "content": "a"}, {"role": "robot", "content": "b"}]}',
     r"line 2: response\[1\] must be"),
    ('{"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "1"}, "response": []}',
     "line 2: 'response' must be a non-empty list"),
])
def test_a_bad_trace_line_is_refused_naming_the_file_and_line(tokenizer, tmp_path, line, problem):
    calls = call_format(ToolsConfig(enabled=True), tokenizer, ["python"])
    path = write_traces(tmp_path / "traces.jsonl", make_tool_split(0, 1, 0).train, calls)
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(DataError, match=f"warm_start.traces: {path} {problem}"):
        read_traces(path, tokenizer, max_prompt_length=64, system_prompt=None, calls=calls)
    read_traces(write_traces(path, make_tool_split(0, 1, 0).train, calls), tokenizer, max_prompt_length=64,
                system_prompt=None, calls=calls)  # control: the good line alone reads


def test_a_warm_start_trains_on_the_traces_file(tokenizer, tmp_path):
    torch.manual_seed(0)
    calls = call_format(ToolsConfig(enabled=True), tokenizer, ["python"])
    path = write_traces(tmp_path / "traces.jsonl", make_tool_split(5, 12, 0).train, calls)
    config = load_config(EXAMPLE, [f"warm_start.traces={path}", "warm_start.max_steps=2", "warm_start.eval_every=2",
                                   "warm_start.batch_size=4", "rollout.tools.pool_size=1"])
    tiny = TinyModelConfig(hidden_size=32, num_layers=1, num_attention_heads=2, num_key_value_heads=2,
                           intermediate_size=64)
    hf_config = tiny_qwen2_config(tiny, tokenizer)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = warm_start_on_synthetic_task(config, model, tokenizer, hf_config)
    assert report["steps"] == 2 and [step for step, _ in report["history"]] == [2]
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    # tools off: a trace holding a tool's answer is refused, naming the switch
    off = load_config(EXAMPLE, [f"warm_start.traces={path}", "rollout.tools.enabled=false"])
    with pytest.raises(DataError, match="rollout.tools.enabled is off"):
        warm_start_on_synthetic_task(off, model, tokenizer, hf_config)
