"""Steps 5–7 of a DAPO step, the data side: scored groups → policy samples with advantages (and overlong-filtering
masks), π_old's log-probs attached, and the seeded split into the mini-batches of the optimizer updates."""

from __future__ import annotations

import dataclasses

import torch

from dapo_megatron.algorithm import group_advantages
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


def mini_batch_indices(count: int, config: DAPOConfig, step: int) -> list[list[int]]:
    """Sample indices shuffled (seeded by run seed and step: the same on every rank, and on a resumed run) and split
    into the mini-batches of the step's optimizer updates."""
    per_mini_batch = config.trainer.mini_batch_size * config.rollout.n_samples
    generator = torch.Generator().manual_seed(config.trainer.seed * 7_919 + step)
    order = torch.randperm(count, generator=generator).tolist()
    return [order[i:i + per_mini_batch] for i in range(0, count, per_mini_batch)]


def mini_batches(samples: list[PolicySample], config: DAPOConfig, step: int) -> list[list[PolicySample]]:
    """The samples of each mini-batch (:func:`mini_batch_indices`)."""
    return [[samples[i] for i in indices] for indices in mini_batch_indices(len(samples), config, step)]
