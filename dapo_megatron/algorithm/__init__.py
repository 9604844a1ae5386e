"""The DAPO algorithm core, one module per pipeline stage (pure PyTorch, no megatron-core):

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

__all__ = [
    "LOSS_AGG_MODES",
    "SURPLUS_POLICIES",
    "DynamicSamplingBuffer",
    "FilterStats",
    "group_accs",
    "group_advantages",
    "merge_micro_batch_metrics",
    "policy_loss",
]
