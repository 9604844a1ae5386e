"""The async rollout driver on the embedded engine (a tiny random model, so dynamic sampling is off here; the trainer
tests run it with filtering on): the staleness bound, partial rollouts on or off at a weight update, a checkpoint taken
with requests in flight that loses no prompt, and engine failures reaching the trainer's thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from test_rollout_streaming import (  # noqa: F401 - one_thread is an autouse fixture
    WAIT_S,
    HoldAtStep,
    one_thread,
    update_while_held,
)
from tiny_models import perturbed_state_dict, sample_prompts
from transformers import AutoTokenizer

from dapo_megatron.config import load_config
from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.reward.scorer import RewardScorer
from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
from dapo_megatron.rollout.engine import RolloutError
from dapo_megatron.rollout.generator import SingleTurnGenerator
from dapo_megatron.collectors.asynchronous import AsyncRolloutCollector

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
BATCH = 4


@pytest.fixture(scope="module")
def records(model_dir):
    return [PromptRecord(prompt_ids=tuple(p), ground_truth="7", data_source="t", index=i, text="")
            for i, p in enumerate(sample_prompts(model_dir, 40))]


def make(model_dir, records, *overrides, gate=None):
    config = load_config(TINY, ["rollout.mode=async", "rollout.n_samples=2", "rollout.max_response_length=12",
                                f"trainer.train_batch_size={BATCH}", "trainer.mini_batch_size=2",
                                "algorithm.dynamic_sampling=false", "algorithm.overlong_buffer_len=4",
                                "algorithm.rollout_correction=token_tis", *overrides])
    engine = EmbeddedEngine.from_hf_directory(model_dir, version=0, gate=gate)
    sampler = PromptSampler(records, batch_size=BATCH, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return AsyncRolloutCollector(SingleTurnGenerator(engine), sampler, tokenizer, config, RewardScorer(config)), engine


def update(engine, model_dir, version):
    engine.update_weights([list(perturbed_state_dict(model_dir, scale=0.05, seed=version).items())], version)


def wait_until(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def staleness(groups, policy_version):
    return [policy_version - g.weight_version for g in groups]


def balanced(metrics) -> bool:
    ledger = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith("async/ledger/")}
    return ledger["drawn"] == ledger["trained"] + ledger["filtered"] + ledger["dropped"] + ledger["held"]


def test_batches_respect_the_staleness_bound_and_too_stale_groups_are_dropped(model_dir, records):
    collector, engine = make(model_dir, records, "rollout.max_staleness=1")
    try:
        seen = []
        for step in range(3):
            groups, metrics = collector.collect(step)
            assert len(groups) == BATCH and balanced(metrics)
            seen += staleness(groups, step)
            wait_until(lambda: len(collector.buffer) >= BATCH)  # "training": the driver fills the next batch
            update(engine, model_dir, step + 1)
        assert max(seen) <= 1 and 1 in seen, "one batch ahead: groups are one version old"
        # the trainer falls behind by two updates: what was buffered is now 2 versions old and must not train
        update(engine, model_dir, 4)
        update(engine, model_dir, 5)
        groups, metrics = collector.collect(5)
        assert max(staleness(groups, 5)) <= 1
        assert metrics["async/dropped_groups"] + metrics["async/aborted_requests"] > 0
        assert metrics["rollout/wasted_tokens/dropped"] + metrics["rollout/wasted_tokens/aborted"] > 0
        assert balanced(metrics)
    finally:
        collector.close()
        engine.shutdown()


@pytest.mark.parametrize("partial", [True, False])
def test_requests_in_flight_at_an_update_continue_or_restart_per_partial_rollouts(model_dir, records, partial):
    gate = HoldAtStep(hold_at=2 + 5)  # the first chunk's rows stop after 5 tokens
    collector, engine = make(model_dir, records, f"rollout.partial_rollouts={str(partial).lower()}",
                             "rollout.max_staleness=2", gate=gate)
    try:
        collector.start()
        update_while_held(engine, gate, perturbed_state_dict(model_dir, scale=0.05, seed=1), 1)
        groups, metrics = collector.collect(1)
        spans = [g.token_versions is not None for g in groups]
        if partial:  # continued on the new weights: each response holds tokens of both versions
            assert all(spans) and all(g.weight_version == 0 for g in groups)
            assert all(v[:5] == [0] * 5 and set(v[5:]) == {1} for g in groups for v in g.token_versions)
            assert metrics["async/aborted_requests"] == 0
        else:  # aborted at the update and generated again on the new weights
            assert not any(spans) and all(g.weight_version == 1 for g in groups)
            assert metrics["async/aborted_requests"] >= BATCH and metrics["rollout/wasted_tokens/aborted"] > 0
            assert metrics["async/ledger/requeued"] >= BATCH
        assert balanced(metrics)
    finally:
        collector.close()
        engine.shutdown()


def test_checkpoints_taken_with_requests_in_flight_lose_no_prompt(model_dir, records):
    gate = HoldAtStep(hold_at=1)  # the first chunk is frozen in flight
    collector, engine = make(model_dir, records, gate=gate)
    collector.start()
    assert gate.reached.wait(WAIT_S)
    state = collector.state_dict()  # what a checkpoint holds (the trainer pickles it)
    in_flight = sorted(tuple(record.prompt_ids) for record in collector.prompts.in_flight_records())
    gate.release.set()
    collector.close()
    engine.shutdown()
    assert len(in_flight) == BATCH and state["ledger"]["drawn"] == BATCH and not state["buffer"]["groups"]
    assert sorted(tuple(r.prompt_ids) for r in state["pending_prompts"]) == in_flight

    trained = []
    for _ in range(2):  # resume, train a step, checkpoint with whatever is buffered or in flight, resume again
        resumed, engine = make(model_dir, records)
        step = len(trained) // BATCH
        if step:
            update(engine, model_dir, step)  # as the trainer does: the engine serves the policy's version
        try:
            resumed.load_state_dict(state)
            regenerated = len(state["pending_prompts"])
            batch, metrics = resumed.collect(step)
            trained += [tuple(g.prompt_ids) for g in batch]
            assert metrics["async/regenerated_prompts"] == regenerated and balanced(metrics)
            time.sleep(0.2)  # let the driver get ahead
            state = resumed.state_dict()
        finally:
            resumed.close()
            engine.shutdown()
    assert sorted(trained[:BATCH]) == in_flight  # the prompts in flight at the first checkpoint trained first
    held = [tuple(g.prompt_ids) for g in state["buffer"]["groups"]] + [tuple(r.prompt_ids)
                                                                       for r in state["pending_prompts"]]
    drawn = [tuple(r.prompt_ids) for r in PromptSampler(records, batch_size=BATCH, seed=0).next_batch(
        state["ledger"]["drawn"])]
    assert state["ledger"]["filtered"] == state["ledger"]["dropped"] == 0
    assert sorted(trained + held) == sorted(drawn)  # every prompt drawn was trained or is held, exactly once


def test_an_engine_failure_in_the_driver_reaches_collect(model_dir, records):
    gate = HoldAtStep(hold_at=3)
    collector, engine = make(model_dir, records, gate=gate)
    try:
        collector.start()
        assert gate.reached.wait(WAIT_S)
        errors = []

        def bad_update():
            try:
                engine.update_weights([[("model.norm.weight", torch.zeros(3))]], 1)
            except ValueError as error:
                errors.append(error)

        bad = threading.Thread(target=bad_update)
        bad.start()
        gate.wait_for_update(engine, -1)
        gate.release.set()
        bad.join(WAIT_S)
        assert errors, "the update with a wrong tensor must fail"
        started = time.monotonic()
        with pytest.raises(RolloutError, match="lost its weights"):
            collector.collect(0)
        assert time.monotonic() - started < WAIT_S
    finally:
        collector.close()
        engine.shutdown()


def test_the_driver_scores_with_the_runs_reward_function(model_dir, records, tmp_path):
    """The async driver scores in the same place as sync mode (rollout_group.score_groups): your reward function,
    in its worker processes, with its extras in the metrics."""
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': 0.25, 'acc': extra_info['index'] % 2 == 0, 'index': extra_info['index']}\n")
    collector, engine = make(model_dir, records, f"reward.function={reward}:compute_score", "reward.num_workers=1",
                             "algorithm.overlong_penalty=false")
    try:
        groups, metrics = collector.collect(0)
        index_of = {tuple(r.prompt_ids): r.index for r in records}
        assert len(groups) == BATCH and all(g.scores == [0.25, 0.25] for g in groups)
        assert all(g.accs == [index_of[tuple(g.prompt_ids)] % 2 == 0] * 2 for g in groups)
        assert metrics["reward/errors"] == 0 and "reward/extra/index" in metrics
    finally:
        collector.close()
        collector.reward.close()
        engine.shutdown()
