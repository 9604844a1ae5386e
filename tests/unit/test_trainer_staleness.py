"""Staleness in the trainer: counted against the policy's version, what the loss does with old-version tokens in each
mode, the surplus default, and the metrics of a step that generated nothing."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from dapo_megatron.algorithm import FilterStats
from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.trainer.policy_update import PolicyUpdate, with_old_logprobs
from dapo_megatron.collectors.group import RolloutGroup
from dapo_megatron.collectors.rollout_metrics import rollout_metrics
from dapo_megatron.metrics.step import staleness_of_batch

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def _group(version, token_versions=None, logprob=-1.0):
    return RolloutGroup(prompt_ids=[5, 6], ground_truth="1", data_source="t", responses=[[7, 7, 7], [8, 8, 8]],
                        engine_logprobs=[[logprob] * 3, [logprob] * 3], finish_reasons=["stop", "stop"],
                        accs=[True, False], scores=[1.0, -1.0], overlong_penalties=[0.0, 0.0],
                        weight_version=version, token_versions=token_versions)


def training_samples(groups, config):
    return PolicyUpdate(None, config).training_samples(groups)  # steps 5 and 6b need no actor


def _samples(groups, config, policy_logprob=-1.0):
    samples = training_samples(groups, config)
    return with_old_logprobs(samples, [torch.full((s.response_length,), policy_logprob) for s in samples])


def corrected_samples(samples, groups, config, *, policy_version):
    """Step 6b as the stage runs it before the updates: the samples the loss sees, and the diagnostics."""
    stage = PolicyUpdate(None, config)
    assert stage.corrects_loss
    correction = stage.correction(samples, groups, policy_version=policy_version)
    return stage.corrected(samples, correction), correction.metrics


def test_a_batch_of_carried_groups_is_all_stale():
    """The measured defect: at step 2 all 32 groups came from step 1's surplus, yet 0.0 stale was logged."""
    carried = [_group(version=1) for _ in range(32)]
    metrics = staleness_of_batch(carried, policy_version=2)
    assert metrics["train/stale_group_fraction"] == 1.0
    assert metrics["rollout/staleness/hist/1"] == 1.0
    fresh = staleness_of_batch([_group(version=2)] * 3 + [_group(version=1)], policy_version=2)
    assert fresh["train/stale_group_fraction"] == 0.25


def test_a_partial_rollout_is_as_stale_as_its_oldest_token():
    spanning = _group(version=1, token_versions=[[1, 2, 2], [2, 2, 2]])
    metrics = staleness_of_batch([spanning], policy_version=2)
    assert metrics["train/stale_group_fraction"] == 1.0
    assert metrics["rollout/staleness/hist/0"] == 0.5 and metrics["rollout/staleness/hist/1"] == 0.5


def test_a_step_that_generated_nothing_has_no_rollout_accuracy():
    batch = [_group(version=1)]
    without = rollout_metrics(batch, [], FilterStats(), rounds=0, hit_cap=False, max_response_length=8)
    assert "rollout/acc/mean" not in without and without["rollout/num_samples"] == 0
    generated = rollout_metrics(batch, batch, FilterStats(1, 1, 0, 0), rounds=1, hit_cap=False, max_response_length=8)
    assert generated["rollout/acc/mean"] == 0.5


def test_sync_without_correction_trains_the_samples_unchanged():
    config = load_config(TINY, ["rollout.n_samples=2", "algorithm.surplus_policy=keep"])
    stage = PolicyUpdate(None, config)
    assert not stage.corrects_loss  # the explicit off-policy choice: the loss takes the samples as they are
    assert not PolicyUpdate(None, load_config(TINY, ["rollout.n_samples=2"])).corrects_loss
    # control: a correction, or async mode's stale masking, changes what the loss sees
    assert PolicyUpdate(None, load_config(TINY, ["rollout.n_samples=2", "rollout.mode=async"])).corrects_loss
    assert PolicyUpdate(None, load_config(TINY, ["algorithm.rollout_correction=seq_mis"])).corrects_loss
    correction = stage.correction(_samples([_group(version=1)], config), [_group(version=1)], policy_version=2)
    assert "rollout_corr/kl_k1" in correction.metrics  # ... but the engine–policy gap is still reported


def test_async_without_correction_masks_old_version_tokens():
    config = load_config(TINY, ["rollout.n_samples=2", "rollout.mode=async"])
    groups = [_group(version=1, token_versions=[[1, 2, 2], [2, 2, 2]])]
    corrected, metrics = corrected_samples(_samples(groups, config), groups, config, policy_version=2)
    assert corrected[0].loss_mask.tolist() == [0.0, 1.0, 1.0]  # the version-1 token is out of the loss
    assert corrected[1].loss_mask.tolist() == [1.0, 1.0, 1.0]
    assert float(corrected[0].advantage) == float(training_samples(groups, config)[0].advantage)  # not weighted
    assert metrics["rollout_corr/masked_token_fraction"] == pytest.approx(1 / 6)


def test_token_tis_weights_every_token_by_its_truncated_ratio():
    config = load_config(TINY, ["rollout.n_samples=2", "rollout.mode=async", "algorithm.rollout_correction=token_tis",
                                "algorithm.tis_cap=1.5"])
    groups = [_group(version=1, logprob=-1.0)]  # π_rollout = e^-1 for every token
    plain = training_samples(groups, config)
    corrected, _ = corrected_samples(_samples(groups, config, policy_logprob=-0.8), groups, config, policy_version=2)
    ratio = math.exp(-0.8 + 1.0)  # 1.22 < cap
    for before, after in zip(plain, corrected):
        assert after.advantage.tolist() == pytest.approx([float(before.advantage) * ratio] * 3, rel=1e-6)
        assert after.loss_mask.tolist() == [1.0, 1.0, 1.0]  # stale, but corrected rather than masked
    capped, _ = corrected_samples(_samples(groups, config, policy_logprob=0.0), groups, config, policy_version=2)
    assert capped[0].advantage.tolist() == pytest.approx([float(plain[0].advantage) * 1.5] * 3, rel=1e-6)


def test_seq_mis_masks_a_response_and_keeps_overlong_filter_masks():
    config = load_config(TINY, ["rollout.n_samples=2", "algorithm.rollout_correction=seq_mis",
                                "algorithm.mis_threshold=2.0"])
    group = _group(version=2)
    group.finish_reasons = ["length", "stop"]  # response 0 overlong-filtered
    samples = _samples([group], config, policy_logprob=-1.0)
    samples[1] = dataclasses.replace(samples[1], old_logprobs=torch.full((3,), -3.0))
    corrected, metrics = corrected_samples(samples, [group], config, policy_version=2)
    assert corrected[0].loss_mask.tolist() == [0.0, 0.0, 0.0]  # the overlong filter's mask survives
    assert corrected[1].loss_mask.tolist() == [0.0, 0.0, 0.0]  # exp(-3 + 1) = 0.135 < 1/2: rejected
    assert metrics["rollout_corr/mis_rejected_fraction"] == 0.5


def test_surplus_default_follows_the_reference_recipe_unless_corrected():
    assert load_config(TINY).algorithm.resolved_surplus_policy == "drop"
    assert load_config(TINY, ["algorithm.rollout_correction=token_tis"]).algorithm.resolved_surplus_policy == "keep"
    assert load_config(TINY, ["algorithm.surplus_policy=keep"]).algorithm.resolved_surplus_policy == "keep"
    assert load_config(TINY, ["algorithm.rollout_correction=both",
                              "algorithm.surplus_policy=drop"]).algorithm.resolved_surplus_policy == "drop"


def test_async_settings_are_checked():
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        load_config(TINY, ["rollout.mode=async", "rollout.max_staleness=0"])
    with pytest.raises(ConfigError, match="algorithm.rollout_correction"):
        load_config(TINY, ["algorithm.rollout_correction=tis"])
    with pytest.raises(ConfigError, match="algorithm.mis_threshold"):
        load_config(TINY, ["algorithm.mis_threshold=0.5"])


def test_the_step_reads_a_handed_over_batch_without_walking_its_tokens(monkeypatch):
    """Issue 26, item 6: every rank holds the batch as tensors (rollout_batch); staleness, the correction's masks and
    the step's metrics must not turn them back into per-token Python values. Iterating a tensor raises here."""
    from dapo_megatron.policy.actor import PolicyLogProbs
    from dapo_megatron.collectors.batch import pack_rollout_batch, unpack_rollout_batch
    from dapo_megatron.metrics.step import policy_metrics

    config = load_config(TINY, ["rollout.n_samples=2", "rollout.mode=async"])
    made = [_group(version=1, token_versions=[[1, 2, 2], [2, 2, 2]]), _group(version=2)]
    groups, _ = unpack_rollout_batch(pack_rollout_batch(made, {}))
    samples = _samples(groups, config)
    old = PolicyLogProbs([s.old_logprobs for s in samples], [torch.zeros(s.response_length) for s in samples])

    def walked(tensor):
        raise AssertionError(f"iterated a tensor of {tensor.numel()} values in Python")

    monkeypatch.setattr(torch.Tensor, "__iter__", walked)
    corrected, correction = corrected_samples(samples, groups, config, policy_version=2)
    staleness = staleness_of_batch(groups, policy_version=2)
    rollout = rollout_metrics(groups, groups, FilterStats(), 1, False, 8)
    policy = policy_metrics(groups, corrected, old, [{"skipped": 0.0, "pg_loss": 0.1, "clipfrac_high": 0.0,
                                                      "clipfrac_low": 0.0, "clipfrac_dual": 0.0, "approx_kl": 0.0,
                                                      "grad_norm": 1.0, "lr": 1e-6, "packing_efficiency": 1.0}],
                            correction, policy_version=2)
    monkeypatch.undo()
    assert corrected[0].loss_mask.tolist() == [0.0, 1.0, 1.0]  # the same answers as from lists
    assert staleness["rollout/staleness/hist/1"] == 0.25 and staleness["train/stale_group_fraction"] == 0.5
    assert rollout["rollout/gen_prob/mean"] == pytest.approx(math.exp(-1.0))
    assert policy["rollout/logprob_diff/max_abs"] == 0.0  # the fresh group's engine and policy log-probs agree


def test_control_a_per_token_walk_is_what_the_check_above_catches(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "__iter__", lambda tensor: (_ for _ in ()).throw(AssertionError("walked")))
    with pytest.raises(AssertionError, match="walked"):
        [float(value) for value in torch.zeros(3)]
