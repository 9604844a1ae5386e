"""The DAPO algorithm core, one module per pipeline stage (pure PyTorch, no megatron-core):

- ``dynamic_sampling.py``: keep groups with 0 < #correct < G until the batch is full
- ``advantages.py``: group-normalized advantages (R − mean) / (std + eps)
- ``objectives.py``: the policy loss and advantage estimator of a run, by name from the ``algorithm`` section
- ``loss.py``: decoupled-clip (Clip-Higher) policy loss, token-mean aggregation, optional dual clip ("dapo")
- ``gspo.py``: sequence-level ratio and clip (GSPO, GSPO-token); ``cispo.py``: clipped stop-gradient IS weight
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
from dapo_megatron.algorithm.objectives import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    PolicyLoss,
    build_advantage_estimator,
    build_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "SURPLUS_POLICIES",
    "DynamicSamplingBuffer",
    "FilterStats",
    "PolicyLoss",
    "build_advantage_estimator",
    "build_policy_loss",
    "group_accs",
    "group_advantages",
    "merge_micro_batch_metrics",
    "policy_loss",
]
