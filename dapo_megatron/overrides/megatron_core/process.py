"""Fixes of megatron-core 0.16.1 that every backend needs, for the whole process: :func:`apply_megatron_core_overrides`,
called by ``Backend.prepare_process`` before megatron-core does anything.

* ``megatron.core.transformer.moe.moe_utils`` imports ``te_general_gemm`` inside a ``try`` that only succeeds with
  Transformer Engine, and the MoE router's GEMM (``RouterGatingLinearFunction``) then tests
  ``te_general_gemm is not None``: without Transformer Engine that is a ``NameError`` at the first MoE forward (seen
  on CPU; the CUDA backend without TE takes the same path). Defining the name as None selects the function's own
  ``torch.mm`` path, which is what the test means.
* Its MoE token dispatcher gathers the routing counts with ``torch.distributed.all_gather_into_tensor``, which torch
  2.13 deprecates with a FutureWarning on every call (every MoE layer of every forward; the batch planner's
  ``catch_warnings`` resets the once-per-location registry, so each update prints it again). The call is megatron's
  and works; the warning is silenced, by its message only.
"""

from __future__ import annotations

import warnings

from megatron.core.transformer.moe import moe_utils

ALL_GATHER_DEPRECATION = r"`torch\.distributed\.all_gather_into_tensor` is deprecated"


def apply_megatron_core_overrides() -> None:
    """Every fix of this module (idempotent)."""
    define_missing_transformer_engine_names()
    silence_all_gather_deprecation()


def define_missing_transformer_engine_names() -> None:
    """Make the router GEMM's "is Transformer Engine's GEMM there?" test answer no instead of raising."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def silence_all_gather_deprecation() -> None:
    """Ignore torch's deprecation notice for the all-gather megatron calls, and nothing else."""
    warnings.filterwarnings("ignore", category=FutureWarning, message=ALL_GATHER_DEPRECATION)
