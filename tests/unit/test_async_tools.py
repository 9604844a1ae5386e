"""Tools under async rollouts: the async driver streams multi-turn trajectories through the same rollout generator as
sync mode, and a weight update that lands while a trajectory's tool call is out is handled per
``rollout.partial_rollouts`` — continued (the next turn sampled by the new weights, every token keeping its version,
the tool's tokens the version of the turn before) or aborted and generated again on the new weights.

The model (tests/tool_traces.py) writes ``print(6*7)`` in a python block and, after the answer, ``Answer: 42``; the
tool is a function of ours that holds every call until the test has updated the weights (to the same values under a
new version, so the trajectories' tokens stay the reference's and only their versions tell the turns apart)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tool_traces import build_tool_model, tool_trace
from transformers import AutoTokenizer

from dapo_megatron.collectors.asynchronous import AsyncRolloutCollector
from dapo_megatron.config import load_config
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.reward.scorer import RewardScorer
from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
from dapo_megatron.rollout.factory import build_rollout_generator
from dapo_megatron.tools import FunctionToolConfig

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
WAIT_S = 60.0
HELD_TOOL = '''
import os, time

def python(text, metadata):
    folder = os.environ["HELD_TOOL_DIR"]
    open(os.path.join(folder, f"started-{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.01)
    return "42"
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tool_model(tmp_path_factory.mktemp("tool_model"))


def wait_until(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def collect_within(collector, step: int):
    """``collector.collect(step)``, failing after WAIT_S instead of waiting for ever (a trajectory the generator
    lost never comes back)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(collector.collect(step)), daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert result, f"collect({step}) did not return within {WAIT_S} s"
    return result[0]


def balanced(metrics) -> bool:
    ledger = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith("async/ledger/")}
    return ledger["drawn"] == ledger["trained"] + ledger["filtered"] + ledger["dropped"] + ledger["held"]


@pytest.mark.parametrize("partial", [True, False])
def test_a_tool_call_out_at_a_weight_update_continues_or_restarts_per_partial_rollouts(model_dir, tmp_path,
                                                                                       monkeypatch, partial):
    (tmp_path / "held_tool.py").write_text(HELD_TOOL)
    monkeypatch.setenv("HELD_TOOL_DIR", str(tmp_path))
    config = load_config(TINY, ["rollout.mode=async", "rollout.n_samples=2", "rollout.max_response_length=60",
                                "trainer.train_batch_size=2", "trainer.mini_batch_size=1",
                                "algorithm.dynamic_sampling=false", "algorithm.overlong_buffer_len=4",
                                "algorithm.rollout_correction=token_tis", "rollout.tools.enabled=true",
                                "rollout.tools.code=false", "rollout.tools.pool_size=8",
                                f"rollout.partial_rollouts={str(partial).lower()}"])
    config.rollout.tools.functions = [FunctionToolConfig(function=f"{tmp_path / 'held_tool.py'}:python")]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    trace = tool_trace(tokenizer)
    engine = EmbeddedEngine.from_hf_directory(model_dir, version=0)
    rollouts = build_rollout_generator(config.rollout, engine, tokenizer)
    collector = AsyncRolloutCollector(rollouts, PromptSampler(trace.records(8), batch_size=2, seed=0), tokenizer,
                                      config, RewardScorer(config))
    try:
        collector.start()
        wait_until(lambda: list(tmp_path.glob("started-*")))  # a trajectory is waiting on its tool call
        weights = load_file(str(model_dir / "model.safetensors"))
        engine.update_weights([list(weights.items())], 1)  # the same weights as version 1
        (tmp_path / "go").touch()
        groups, metrics = collect_within(collector, 1)
    finally:
        (tmp_path / "go").touch()
        collector.close()
        collector.reward.close()
        engine.shutdown()
    assert len(groups) == 2 and balanced(metrics) and metrics["tools/calls"] > 0
    responses = [(list(r), list(m), [int(v) for v in g.response_versions(i)]) for g in groups
                 for i, (r, m) in enumerate(zip(g.responses, g.loss_masks))]
    assert all(ids == trace.response and mask == trace.loss_mask for ids, mask, _ in responses)
    call, output = len(trace.call), len(trace.output)
    if partial:  # continued: the answer after the tool sampled by version 1, the call and the tool's tokens version 0
        spanning = [versions for _, _, versions in responses if len(set(versions)) == 2]
        assert spanning and all(v == [0] * (call + output) + [1] * len(trace.answer) for v in spanning)
        assert metrics["async/aborted_requests"] == 0
    else:  # aborted with the call out and generated again on version 1: every trained token is version 1's
        assert all(set(versions) == {1} for _, _, versions in responses)
        assert metrics["async/aborted_requests"] >= 1 and metrics["async/ledger/requeued"] >= 1
