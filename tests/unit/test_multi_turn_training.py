"""Multi-turn responses in training: tool-output tokens get no gradient through the real actor and loss (a control
where they would), their mask survives the batch's way to every rank, the rollout correction and the statistics
read only sampled tokens, the overlong punishment reads the full length."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from actor_harness import actor_settings, build_test_actor, gather_hf_weights, write_tiny_qwen2
from spawn_ranks import run_distributed

from dapo_megatron.algorithm.rollout_correction import rollout_correction
from dapo_megatron.algorithm.sampled_tokens import correction_of_sampled
from dapo_megatron.collectors.batch import pack_rollout_batch, unpack_rollout_batch
from dapo_megatron.collectors.group import RolloutGroup, _overlong_penalties
from dapo_megatron.config import OptimConfig, load_config
from dapo_megatron.algorithm import FilterStats
from dapo_megatron.collectors.rollout_metrics import rollout_metrics, tool_metrics
from dapo_megatron.rollout.engine import Sample, ToolUse
from dapo_megatron.trainer.policy_update import PolicyUpdate

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
SAMPLED = [11, 12, 13, 14]
MASK = [1, 1, 1, 1, 0, 0, 0]  # the tool's answer closes the response: no sampled token reads it


def multi_turn_group(tool_ids: list[int], masked: bool) -> RolloutGroup:
    responses = [SAMPLED + tool_ids, [21, 22, 23]]
    return RolloutGroup(prompt_ids=[5, 6, 7], ground_truth="1", data_source="t", responses=responses,
                        engine_logprobs=[[-1.0] * 4 + [0.0] * 3, [-1.0] * 3], finish_reasons=["stop", "stop"],
                        accs=[True, False], scores=[1.0, -1.0], overlong_penalties=[0.0, 0.0], weight_version=0,
                        loss_masks=[MASK, [1, 1, 1]] if masked else None,
                        tool_use=[ToolUse(turns=2, calls=1, output_tokens=3), ToolUse(turns=1)])


def update_job(hf_dir: str) -> dict:
    """One optimizer update on the batch as the trainer builds it (groups → every rank → samples → actor), for two
    different tool answers, with and without the mask."""
    config = load_config(TINY, ["trainer.train_batch_size=1", "trainer.mini_batch_size=1", "rollout.n_samples=2"])
    settings = actor_settings(optim=OptimConfig(lr=1e-2, adam_eps=1e-3, grad_clip=1e6, weight_decay=0.0))
    weights = {}
    for masked in (True, False):
        for tool_ids in ([31, 32, 33], [41, 42, 43]):
            groups, _ = unpack_rollout_batch(pack_rollout_batch([multi_turn_group(tool_ids, masked)], {}))
            actor, spec = build_test_actor(hf_dir, 1, 1, settings)
            stage = PolicyUpdate(actor, config)
            samples = stage.training_samples(groups)
            old = actor.compute_logprobs(samples)
            actor.train_minibatch([dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(samples, old.logprobs)],
                                  stage.loss)
            weights[masked, tool_ids[0]] = gather_hf_weights(actor, spec)
    return weights


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(write_tiny_qwen2(tmp_path_factory.mktemp("tools") / "hf", num_layers=2))


def test_tool_output_tokens_get_no_gradient(hf_dir):
    weights = run_distributed(update_job, 1, hf_dir)[0]
    # masked: what the tool answered does not change the update at all
    for name, value in weights[True, 31].items():
        torch.testing.assert_close(weights[True, 41][name], value, atol=0, rtol=0, msg=name)
    # control: without the mask the tool tokens are trained, so their ids change the update
    differs = [name for name, value in weights[False, 31].items() if not torch.equal(weights[False, 41][name], value)]
    assert "lm_head.weight" in differs


def test_loss_masks_cross_to_every_rank_and_single_turn_batches_pack_as_before():
    group = multi_turn_group([31, 32, 33], masked=True)
    [back], _ = unpack_rollout_batch(pack_rollout_batch([group], {}))
    assert [m.tolist() for m in back.loss_masks] == [[bool(v) for v in MASK], [True] * 3]
    assert back.loss_mask(0).tolist() == [bool(v) for v in MASK]
    plain = dataclasses.replace(group, loss_masks=None, tool_use=None)
    packed = pack_rollout_batch([plain], {})
    assert "loss_masks" not in packed.tensors and "has_loss_masks" not in packed.tensors
    [back], _ = unpack_rollout_batch(packed)
    assert back.loss_masks is None and back.loss_mask(0) is None


def test_training_samples_and_with_overlong_filtering():
    config = load_config(TINY, ["rollout.n_samples=2"])
    [tooled, plain] = PolicyUpdate(None, config).training_samples([multi_turn_group([31, 32, 33], masked=True)])
    assert tooled.loss_mask.tolist() == MASK and plain.loss_mask.tolist() == [1.0] * 3
    truncated = dataclasses.replace(multi_turn_group([31, 32, 33], masked=True), finish_reasons=["length", "stop"])
    [tooled, _] = PolicyUpdate(None, load_config(TINY, ["rollout.n_samples=2", "algorithm.overlong_filtering=true"])
                               ).training_samples([truncated])
    assert tooled.loss_mask.tolist() == [0.0] * 7  # the overlong filter still drops the whole response


def test_rollout_correction_reads_only_sampled_tokens():
    policy = [torch.tensor([-1.1, -0.9, -1.0, -3.0, -2.0, -4.0])]
    engine = [torch.tensor([-1.0, -1.0, -1.0, 0.0, 0.0, 0.0])]  # tool tokens: 0.0, no engine log-prob
    sampled = [torch.tensor([True, True, True, False, False, False])]
    settings = dict(mode="both", tis_cap=2.0, mis_threshold=2.0)
    result = correction_of_sampled(policy, engine, sampled, **settings)
    alone = rollout_correction([policy[0][:3]], [engine[0][:3]], **settings)
    assert result.metrics == alone.metrics and result.metrics["rollout_corr/mis_rejected_fraction"] == 0.0
    assert result.keep[0].tolist() == [True] * 3 + [False] * 3
    torch.testing.assert_close(result.weights[0][:3], alone.weights[0])
    assert result.weights[0][3:].tolist() == [1.0] * 3
    # control: read as sampled, the tool tokens' made-up log-probs reject the whole response
    assert rollout_correction(policy, engine, **settings).metrics["rollout_corr/mis_rejected_fraction"] == 1.0


def test_statistics_leave_tool_output_out_and_tool_metrics():
    groups = [multi_turn_group([31, 32, 33], masked=True)]
    metrics = rollout_metrics(groups, groups, FilterStats(), 1, False, max_response_length=7)
    assert metrics["response_length/mean"] == (4 + 3) / 2  # sampled tokens only
    assert metrics["response_length/clip_ratio"] == 0.5  # the budget counts the tool output: 7 of 7
    assert metrics["rollout/gen_prob/mean"] == pytest.approx(torch.tensor(-1.0).exp().item())
    assert tool_metrics(groups) == {
        "num_turns/mean": 1.5, "num_turns/max": 2.0, "num_turns/min": 1.0, "tools/calls_per_response": 0.5,
        "tools/failed_per_response": 0.0, "tools/timeouts_per_response": 0.0, "tools/output_tokens/mean": 1.5,
        "tools/used_fraction": 0.5, "tools/acc/with_tool": 1.0, "tools/acc/without_tool": 0.0}
    plain = dataclasses.replace(groups[0], loss_masks=None, tool_use=None)
    assert tool_metrics([plain]) == {}
    assert rollout_metrics([plain], [plain], FilterStats(), 1, False, 7)["response_length/mean"] == (7 + 3) / 2


def test_overlong_punishment_reads_the_full_length_tool_output_included():
    config = load_config(TINY, ["rollout.max_response_length=10", "algorithm.overlong_buffer_len=4",
                                "algorithm.overlong_penalty=true"])
    tooled = Sample(0, list(range(9)), [0.0] * 9, "stop", loss_mask=[1] * 3 + [0] * 6)
    plain = Sample(0, list(range(9)), [0.0] * 9, "stop")
    assert _overlong_penalties([tooled], config) == _overlong_penalties([plain], config) != [0.0]
