"""Weight versions and staleness, counted against the policy.

Versions: the policy's weights after ``k`` optimizer steps are version ``k``; the trainer hands them to the rollout
engine tagged ``k`` (:mod:`dapo_megatron.trainer.weight_sync`). Every response token records the version of the
weights that sampled it (``token_versions``); a response continued across a weight update (a partial rollout)
holds two or more versions, in non-decreasing order.

Staleness of a response when the policy at version V trains on it: ``V − (its oldest token's version)``. 0 means
every token was sampled by the weights being trained — on-policy. A token is stale when its version is < V. The
trainer counts staleness against V, the policy's version at the step — never against the newest group of the batch
(which would call a batch made entirely of groups carried over from an earlier step "fresh").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor

TokenVersions = Sequence[int] | Tensor  # one response's per-token versions: a list from the engine, or a tensor


def _versions(token_versions: TokenVersions, policy_version: int | None = None) -> Tensor:
    """The versions as an int64 tensor, checked without a Python loop over the tokens."""
    versions = torch.as_tensor(token_versions, dtype=torch.int64).reshape(-1)
    if versions.numel() > 1 and bool((versions[1:] < versions[:-1]).any()):
        raise ValueError(f"token versions must not decrease along a response, got {versions.tolist()}")
    if policy_version is not None and versions.numel() and int(versions.max()) > policy_version:
        raise ValueError(f"a token of version {int(versions.max())} is newer than the policy (version "
                         f"{policy_version}): the engine served weights the policy never had")
    return versions


def response_staleness(token_versions: TokenVersions, policy_version: int) -> int:
    """``policy_version − min(token_versions)`` (0 for an empty response)."""
    versions = _versions(token_versions, policy_version)
    return policy_version - int(versions.min()) if versions.numel() else 0


def version_span(token_versions: TokenVersions) -> int:
    """How many weight updates a response spans: newest − oldest token version (0 for a single-version response)."""
    versions = _versions(token_versions)
    return int(versions[-1] - versions[0]) if versions.numel() else 0


def stale_token_mask(token_versions: TokenVersions, policy_version: int) -> Tensor:
    """bool ``[R]``: True for tokens sampled by weights older than the policy's."""
    return _versions(token_versions, policy_version) < policy_version


def staleness_metrics(staleness: Sequence[int]) -> dict[str, float]:
    """Mean, max and the histogram (``rollout/staleness/hist/<k>``: fraction of responses with staleness k) of some
    responses' staleness; nothing for no responses."""
    if not staleness:
        return {}
    prefix = "rollout/staleness"
    counts = Counter(staleness)
    metrics = {f"{prefix}/mean": sum(staleness) / len(staleness), f"{prefix}/max": float(max(staleness))}
    metrics.update({f"{prefix}/hist/{k}": counts[k] / len(staleness) for k in range(max(staleness) + 1)})
    return metrics
