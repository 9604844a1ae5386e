"""Steps 5–7 of a DAPO step, the data side: scored groups → policy samples with advantages (and overlong-filtering
masks), π_old's log-probs attached, the rollout correction of tokens the policy did not sample itself, and the
seeded split into the mini-batches of the optimizer updates."""

from __future__ import annotations

import dataclasses

import torch

from dapo_megatron.algorithm import group_advantages
from dapo_megatron.algorithm.rollout_correction import rollout_correction, weighted_advantage
from dapo_megatron.algorithm.staleness import stale_token_mask
from dapo_megatron.config import DAPOConfig
from dapo_megatron.policy.packing import PolicySample
from dapo_megatron.trainer.rollout_collector import RolloutGroup


def training_samples(groups: list[RolloutGroup], config: DAPOConfig) -> list[PolicySample]:
    """Groups → one PolicySample per response: group-normalized advantage; a zero loss mask for a truncated
    response when overlong filtering is on."""
    if not groups:
        return []
    scores = torch.tensor([g.scores for g in groups], dtype=torch.float32)
    advantages = group_advantages(scores, eps=config.algorithm.advantage_eps)
    samples = []
    for group, group_adv in zip(groups, advantages):
        for response, truncated, adv in zip(group.responses, group.truncated, group_adv.tolist()):
            mask = torch.zeros(len(response)) if (truncated and config.algorithm.overlong_filtering) else None
            samples.append(PolicySample(prompt_ids=group.prompt_ids, response_ids=response, advantage=adv,
                                        loss_mask=mask))
    return samples


def with_old_logprobs(samples: list[PolicySample], old_logprobs: list[torch.Tensor]) -> list[PolicySample]:
    """The samples with π_old's per-token log-probs (the denominators of the importance ratios) attached."""
    return [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(samples, old_logprobs, strict=True)]


def corrects_before_update(config: DAPOConfig) -> bool:
    """Whether :func:`corrected_samples` changes what the loss sees, and so needs π_old's log-probs of every sample
    before the first update (a rollout correction, or async mode's masking of stale tokens); otherwise the samples
    go to the loss as they are and the correction's diagnostics can wait for π_old until after the updates."""
    return config.algorithm.rollout_correction != "none" or config.rollout.mode == "async"


def corrected_samples(samples: list[PolicySample], groups: list[RolloutGroup], config: DAPOConfig, *,
                      policy_version: int) -> tuple[list[PolicySample], dict[str, float]]:
    """Step 6b: the samples (π_old attached, in ``training_samples`` order) as the loss must see them, and the
    engine–policy diagnostics (``rollout_corr/*``).

    ``algorithm.rollout_correction`` token_tis / seq_mis / both: every token is importance-weighted (per-token
    advantage w·A) and/or its response masked, stale or not (:mod:`dapo_megatron.algorithm.rollout_correction`).
    "none": in async mode tokens sampled by older weights than ``policy_version`` are masked out of the loss; in
    sync mode the samples are returned unchanged — stale tokens there come only from ``surplus_policy: keep``,
    which is the explicit choice to train the surplus as it is (off-policy by one version)."""
    a = config.algorithm
    mask_stale = a.rollout_correction == "none" and config.rollout.mode == "async"
    stale = ([stale_token_mask(g.response_versions(i), policy_version) for g in groups for i in range(len(g.responses))]
             if mask_stale else None)
    correction = rollout_correction(
        [s.old_logprobs for s in samples], [torch.tensor(lps) for g in groups for lps in g.engine_logprobs],
        mode=a.rollout_correction, tis_cap=a.tis_cap, mis_threshold=a.mis_threshold, stale=stale)
    if not corrects_before_update(config):  # diagnostics only: the loss takes the samples as they are
        return samples, correction.metrics
    weighted = a.rollout_correction in ("token_tis", "both")
    corrected = []
    for sample, weight, keep in zip(samples, correction.weights, correction.keep, strict=True):
        mask = sample.response_tensors()[0] * keep
        advantage = weighted_advantage(sample.advantage, weight) if weighted else sample.advantage
        corrected.append(dataclasses.replace(sample, advantage=advantage, loss_mask=mask))
    return corrected, correction.metrics


def mini_batch_indices(count: int, config: DAPOConfig, step: int) -> list[list[int]]:
    """Sample indices shuffled (seeded by run seed and step: the same on every rank, and on a resumed run) and split
    into the mini-batches of the step's optimizer updates."""
    per_mini_batch = config.trainer.mini_batch_size * config.rollout.n_samples
    generator = torch.Generator().manual_seed(config.trainer.seed * 7_919 + step)
    order = torch.randperm(count, generator=generator).tolist()
    return [order[i:i + per_mini_batch] for i in range(0, count, per_mini_batch)]
