"""Group-relative advantages (GRPO / DAPO, no value function).

For group g of G responses to one prompt with rewards R_{g,1..G}:

    Â_{g,i} = (R_{g,i} − mean_j R_{g,j}) / (std_j R_{g,j} + eps)

std is the unbiased sample standard deviation (``torch.std``, divisor G − 1), as in the reference recipe, and
eps (``algorithm.advantage_eps``) keeps all-equal groups finite (their advantages are exactly 0). Every token of
response i shares Â_{g,i}.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, *, eps: float) -> Tensor:
    """Per-response advantages from a [num_groups, G] reward tensor; returns float32 [num_groups, G]."""
    if rewards.dim() != 2:
        raise ValueError(f"group_advantages: rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"group_advantages: need G >= 2 responses per group for a std, got G={rewards.shape[1]}")
    if eps <= 0:
        raise ValueError(f"group_advantages: eps must be positive, got {eps}")
    rewards = rewards.to(torch.float32)
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)
