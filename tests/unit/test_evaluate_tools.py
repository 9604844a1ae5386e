"""Validation with tools on goes through the multi-turn loop (greedy, the run's tools) and reports the accuracy split
by tool use; the control, tools off, answers the same prompts single-turn. The model (tests/tool_traces.py) writes a
python call and, after the tool's answer, ``Answer: 42``; the tool here is a function of ours. Answering a text the
model never saw, it shows which responses a tool really answered: those hold it (and, thrown off by it, are wrong),
while a single-turn response writes the answer block itself (``42``, and is right)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tool_traces import build_tool_model, tool_trace
from transformers import AutoTokenizer

from dapo_megatron.config import load_config
from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.reward.scorer import RewardScorer
from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
from dapo_megatron.rollout.factory import build_rollout_generator
from dapo_megatron.rollout.multi_turn import MultiTurnGenerator
from dapo_megatron.tools import FunctionToolConfig, ToolPool
from dapo_megatron.trainer.evaluate import evaluate

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
MARK = "7311"
TOOL = '''
def python(text, metadata):
    assert "ground_truth" not in metadata and metadata["data_source"] == "t"
    return "{answer}"
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tool_model(tmp_path_factory.mktemp("tool_model"))


def setup(model_dir, tool_file: Path, *overrides: str, problems: int = 3):
    """(config with our tool as the only one, tokenizer, records of the model's prompt)"""
    config = load_config(TINY, ["rollout.max_response_length=40", "eval.greedy=true", "eval.log_generations=1",
                                "rollout.tools.code=false", *overrides])
    config.rollout.tools.functions = [FunctionToolConfig(function=f"{tool_file}:python")]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    trace = tool_trace(tokenizer)
    records = [PromptRecord(prompt_ids=tuple(trace.prompt), ground_truth="42", data_source="t", index=i, text="6*7")
               for i in range(problems)]
    return config, tokenizer, records


def validate(model_dir, tool_file: Path, *overrides: str):
    config, tokenizer, records = setup(model_dir, tool_file, *overrides)
    engine = EmbeddedEngine.from_hf_directory(model_dir)
    reward = RewardScorer(config)
    rollouts = build_rollout_generator(config.rollout, engine, tokenizer)
    try:
        return evaluate(rollouts, records, tokenizer, config, reward)
    finally:
        rollouts.close()
        reward.close()
        engine.shutdown()


def test_validation_runs_through_the_tool_loop_and_splits_accuracy_by_tool_use(model_dir, tmp_path):
    (tmp_path / "tool.py").write_text(TOOL.format(answer=MARK))
    result = validate(model_dir, tmp_path / "tool.py", "rollout.tools.enabled=true")
    [generation] = result.generations
    assert f"```output\n{MARK}\n```" in generation["response"]  # the tool's answer, appended by the loop
    m = result.metrics
    assert m["val/all/acc/mean@1"] == 0.0 and m["val/tools/acc/with_tool"] == 0.0
    assert "val/tools/acc/without_tool" not in m  # every response called the tool
    assert (m["val/tools/used_fraction"], m["val/tools/calls_per_response"], m["val/num_turns/mean"]) == (1.0, 1.0, 2.0)
    assert m["val/tools/failed_per_response"] == 0.0
    # control: tools off, validation is single-turn: nothing answered the call, no tool numbers
    plain = validate(model_dir, tmp_path / "tool.py")
    assert MARK not in plain.generations[0]["response"] and plain.generations[0]["response"].endswith("Answer: 42")
    assert plain.metrics["val/all/acc/mean@1"] == 1.0
    assert not any("tools" in key or "num_turns" in key for key in plain.metrics)


def test_validation_calls_run_in_the_pool_it_is_given(model_dir, tmp_path):
    (tmp_path / "tool.py").write_text(TOOL.format(answer="42"))
    config, tokenizer, records = setup(model_dir, tmp_path / "tool.py", "rollout.tools.enabled=true", problems=2)
    engine, reward, pool = (EmbeddedEngine.from_hf_directory(model_dir), RewardScorer(config),
                            ToolPool(config.rollout.tools))
    try:
        rollouts = MultiTurnGenerator(engine, tokenizer, config.rollout.tools, pool)
        metrics = evaluate(rollouts, records, tokenizer, config, reward).metrics
        assert pool.counts()["tools/python/calls"] == 2  # one greedy response per problem, one call each
        assert metrics["val/tools/acc/with_tool"] == metrics["val/all/acc/mean@1"] == 1.0
    finally:
        pool.close()
        reward.close()
        engine.shutdown()
