"""The tool task (data.synthetic.mode: tools) and the warm-start on its traces: problems and split, reference traces
whose output is what the real sandbox prints, tool-output tokens left out of the supervised loss (a control where
they are not)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo_megatron.config import ConfigError, TinyModelConfig, load_config
from dapo_megatron.data.prompts import build_prompt_records
from dapo_megatron.data.schema import validate_row
from dapo_megatron.data.synthetic_tools import ToolTaskConfig, make_tool_split, tool_trace
from dapo_megatron.data.task import synthetic_split
from dapo_megatron.data.tokenizer import build_tiny_tokenizer
from dapo_megatron.tiny_model import tiny_qwen2_config
from dapo_megatron.tiny_model.warm_start import _batch_loss, tool_trace_examples, warm_start_on_synthetic_task
from dapo_megatron.tools import ToolPool, ToolResult, ToolsConfig, call_format

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_cpu_tools.yaml"


def test_tool_split_is_seeded_and_keeps_held_out_expressions_out_of_training():
    split = make_tool_split(0, 300, 50)
    assert split == make_tool_split(0, 300, 50) and split != make_tool_split(1, 300, 50)
    held_out = {p.expression for p in split.heldout}
    assert len(held_out) == 50 and not held_out & {p.expression for p in split.train}
    assert {p.kind for p in split.train} == {"mul", "muladd"}
    for problem in split.train:
        assert problem.answer == eval(problem.expression) and problem.solution == f"Answer: {problem.answer}"
        assert all(100 <= int(n) <= 999 for n in problem.expression.replace("+", "*").split("*"))
    with pytest.raises(ValueError, match="too few distinct expressions"):
        make_tool_split(0, 10, 20, ToolTaskConfig(number_range=(10, 11), muladd_fraction=0.0))


def test_the_config_picks_the_task():
    config = load_config(EXAMPLE)
    assert config.data.synthetic.mode == "tools" and config.rollout.tools.enabled
    assert synthetic_split(config).train[0].kind in ("mul", "muladd")
    assert synthetic_split(load_config(REPO / "examples" / "tiny_cpu.yaml")).train[0].kind in ("mul", "chain")
    baseline = load_config(REPO / "examples" / "tiny_cpu_tools_baseline.yaml")
    assert baseline.data == config.data and not baseline.rollout.tools.enabled  # the same problems, no tools
    assert (baseline.warm_start, baseline.trainer.total_steps) == (config.warm_start, config.trainer.total_steps)
    with pytest.raises(ConfigError, match="data.synthetic.mode"):
        load_config(EXAMPLE, ["data.synthetic.mode=abacus"])


def test_reference_traces_hold_what_the_sandbox_prints():
    pool = ToolPool(ToolsConfig(enabled=True, pool_size=2))
    try:
        for problem in make_tool_split(3, 4, 0).train:
            trace = tool_trace(problem)
            result = pool.call("python", trace.code)
            assert result.ok and result.text == trace.output + "\n"
            assert trace.answer_line == f"Answer: {trace.output}"
    finally:
        pool.close()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _examples(tokenizer, problems):
    tools = ToolsConfig(enabled=True)
    rows = [validate_row(p.to_row(i, "train"), source="t", row=i, integer_answers=True) for i, p in enumerate(problems)]
    records = build_prompt_records(rows, tokenizer, max_prompt_length=64).records
    calls = call_format(tools, tokenizer, ["python"])
    return records, calls, tool_trace_examples(records, problems, tokenizer, calls, "python")


def test_warm_start_traces_are_the_loop_s_tokens_with_the_tool_output_untrained(tokenizer):
    problems = make_tool_split(0, 3, 0).train
    records, call_format, examples = _examples(tokenizer, problems)
    for record, problem, (ids, trained) in zip(records, problems, examples):
        trace = tool_trace(problem)
        call = tokenizer.encode(f"```python\n{trace.code}\n```\n", add_special_tokens=False)
        output = call_format.output_ids(ToolResult("python", trace.output + "\n", True, None, 0.0))
        answer = tokenizer.encode(trace.answer_line, add_special_tokens=False) + [tokenizer.eos_token_id]
        prompt = list(record.prompt_ids)
        assert ids == prompt + call + output + answer
        assert trained == [0] * len(prompt) + [1] * len(call) + [0] * len(output) + [1] * len(answer)
        untrained = [t for t, m in zip(ids[len(prompt):], trained[len(prompt):]) if not m]
        assert tokenizer.decode(untrained) == f"```output\n{problem.answer}\n```\n"


def test_tool_output_tokens_get_no_supervised_gradient(tokenizer):
    torch.manual_seed(0)
    tiny = TinyModelConfig(hidden_size=32, num_layers=1, num_attention_heads=2, num_key_value_heads=2,
                           intermediate_size=64)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(tiny, tokenizer), dtype=torch.float32)
    # each trace up to the end of its output block: an output token is then only ever a label, or the input of
    # another output token's prediction (the answer after it reads the block as input, rightly)
    examples = []
    for ids, trained in _examples(tokenizer, make_tool_split(0, 2, 0).train)[2]:
        end = len(trained) - trained[::-1].index(0)
        examples.append((ids[:end], trained[:end]))
    seven, three = tokenizer.convert_tokens_to_ids("7"), tokenizer.convert_tokens_to_ids("3")

    def other_answer(ids, trained):
        """The same trace as if the tool had answered otherwise: every digit of the output block changed."""
        start = trained.index(1)
        return [(three if t == seven else seven) if i > start and not m and tokenizer.decode([t]).isdigit() else t
                for i, (t, m) in enumerate(zip(ids, trained))]

    changed = [(other_answer(ids, trained), trained) for ids, trained in examples]
    assert all(c != ids for (c, _), (ids, _) in zip(changed, examples))
    pad = tokenizer.pad_token_id
    assert torch.equal(_batch_loss(model, changed, pad), _batch_loss(model, examples, pad))
    # control: with the output block trained too, what the tool answered changes the loss
    everything = [(ids, [int(i >= trained.index(1)) for i in range(len(ids))]) for ids, trained in examples]
    changed_everything = [(c, mask) for (c, _), (_, mask) in zip(changed, everything)]
    assert not torch.equal(_batch_loss(model, changed_everything, pad), _batch_loss(model, everything, pad))


def test_the_warm_start_on_tool_traces_needs_the_python_tool(tokenizer):
    config = load_config(EXAMPLE, ["rollout.tools.code=false", "data.synthetic.num_train=20"])
    with pytest.raises(ConfigError, match="rollout.tools.code: the warm-start's traces"):
        warm_start_on_synthetic_task(config, None, tokenizer, None)


def test_the_warm_start_calls_the_tool_on_its_share_of_the_problems(tokenizer):
    """warm_start.tool_trace_fraction: a seeded share of the references are tool traces (the tool's output block
    untrained), the rest direct answers; 1 (the default) is all traces, 0 none."""
    from dapo_megatron.tiny_model.warm_start import _references

    calls = call_format(ToolsConfig(enabled=True), tokenizer, ["python"])

    def traced(fraction: float, seed: int = 0) -> list[bool]:
        config = load_config(EXAMPLE, ["data.synthetic.num_train=220", f"warm_start.tool_trace_fraction={fraction}",
                                       f"trainer.seed={seed}"])
        examples, _ = _references(config, tokenizer, calls)
        assert len(examples) == 198  # a tenth of the 220 training problems validates
        return [0 in trained[trained.index(1):] for _, trained in examples]  # an untrained output block inside

    half = traced(0.5)
    assert 70 < sum(half) < 130 and half == traced(0.5) and half != traced(0.5, seed=1)
    assert all(traced(1.0)) and not any(traced(0.0))
    with pytest.raises(ConfigError, match="^warm_start.tool_trace_fraction: "):
        load_config(EXAMPLE, ["warm_start.tool_trace_fraction=1.5"])
