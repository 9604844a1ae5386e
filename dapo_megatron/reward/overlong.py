"""Overlong reward shaping: soft overlong punishment and overlong filtering (DAPO §3.4).

Soft punishment, added to the correctness score (the seed's R_length, scaled by ``factor``):

    R_length(L) = 0                                  if L <= L_max − L_cache
                = ((L_max − L_cache) − L) / L_cache  if L_max − L_cache < L <= L_max
                = −1                                 if L > L_max
    penalty = factor · R_length(L)

e.g. L_max = 20,480, L_cache = 4,096, L = 18,432 gives −0.5, so a correct answer scores +1 − 0.5 = +0.5.

Overlong filtering: the tokens of a truncated sample (generation stopped by the length limit, SGLang finish reason
"length") are masked out of the loss, so a cut-off answer neither rewards nor punishes anything.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> Tensor:
    """Soft overlong penalty per sample: 0, then linear down to −factor at ``max_len``, −factor beyond.

    Args:
        lengths: response lengths in tokens, any shape.
        max_len: L_max, the response length limit.
        cache_len: L_cache, the length of the punishment interval before ``max_len``; in (0, max_len].
        factor: penalty at and beyond ``max_len`` (the reference recipe uses 1.0); >= 0.

    Returns:
        float32 tensor of ``lengths``' shape with values in [−factor, 0].
    """
    if max_len <= 0:
        raise ValueError(f"overlong_penalty: max_len must be positive, got {max_len}")
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong_penalty: cache_len must be in (0, max_len={max_len}], got {cache_len}")
    if factor < 0:
        raise ValueError(f"overlong_penalty: factor must be >= 0 (a penalty), got {factor}")
    expected_len = max_len - cache_len
    shaped = (expected_len - lengths.to(torch.float32)) / cache_len
    return shaped.clamp(min=-1.0, max=0.0) * factor


def overlong_filter_mask(mask: Tensor, truncated: Tensor) -> Tensor:
    """Zero the loss mask of truncated samples.

    Args:
        mask: [B, T] loss mask (bool or numeric), 1 for response tokens that count.
        truncated: [B] bool, True where generation stopped at the length limit (finish reason "length").

    Returns:
        a new [B, T] mask of ``mask``'s dtype, all zero in the rows of truncated samples.
    """
    if mask.dim() != 2:
        raise ValueError(f"overlong_filter_mask: mask must be [B, T], got shape {tuple(mask.shape)}")
    if truncated.dtype != torch.bool:
        raise TypeError(f"overlong_filter_mask: truncated must be a bool tensor, got {truncated.dtype}")
    if truncated.shape != mask.shape[:1]:
        raise ValueError(
            f"overlong_filter_mask: truncated must be [B]={mask.shape[0]}, got shape {tuple(truncated.shape)}"
        )
    keep = (~truncated).unsqueeze(-1).to(device=mask.device)
    return mask & keep if mask.dtype == torch.bool else mask * keep.to(mask.dtype)
