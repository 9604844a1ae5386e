"""The DAPO algorithm core, one module per pipeline stage (pure PyTorch, no megatron-core):

- ``reward.py``: rule-based math reward (+1 / −1 on the last ``Answer:``)
- ``overlong.py``: soft overlong penalty added to the reward; loss mask of truncated samples
- ``dynamic_sampling.py``: keep groups with 0 < #correct < G until the batch is full
- ``advantages.py``: group-normalized advantages (R − mean) / (std + eps)
- ``loss.py``: decoupled-clip (Clip-Higher) policy loss, token-mean aggregation, optional dual clip
- ``staleness.py``: weight versions per token; staleness counted against the policy's version
- ``rollout_correction.py``: token-level truncated / sequence-level masked importance sampling of tokens the policy
  did not sample itself (engine numerics, older weights)
"""

from dapo_megatron.algorithm.advantages import group_advantages
from dapo_megatron.algorithm.dynamic_sampling import (
    SURPLUS_POLICIES,
    DynamicSamplingBuffer,
    FilterStats,
    group_accs,
)
from dapo_megatron.algorithm.loss import LOSS_AGG_MODES, merge_micro_batch_metrics, policy_loss
from dapo_megatron.algorithm.overlong import overlong_filter_mask, overlong_penalty
from dapo_megatron.algorithm.reward import RewardResult, extract_answer, math_reward, normalize_answer

__all__ = [
    "LOSS_AGG_MODES",
    "SURPLUS_POLICIES",
    "DynamicSamplingBuffer",
    "FilterStats",
    "RewardResult",
    "extract_answer",
    "group_accs",
    "group_advantages",
    "math_reward",
    "merge_micro_batch_metrics",
    "normalize_answer",
    "overlong_filter_mask",
    "overlong_penalty",
    "policy_loss",
]
