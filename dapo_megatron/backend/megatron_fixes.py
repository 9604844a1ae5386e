"""Fixes of megatron-core 0.16.1 defects that every backend needs, applied by ``Backend.prepare_process``.

* ``megatron.core.transformer.moe.moe_utils`` imports ``te_general_gemm`` inside a ``try`` that only succeeds with
  Transformer Engine, and the MoE router's GEMM (``RouterGatingLinearFunction``) then tests
  ``te_general_gemm is not None``: without Transformer Engine that is a ``NameError`` at the first MoE forward (seen
  on CPU; the CUDA backend without TE takes the same path). Defining the name as None selects the function's own
  ``torch.mm`` path, which is what the test means.
"""

from __future__ import annotations

from megatron.core.transformer.moe import moe_utils


def define_missing_transformer_engine_names() -> None:
    """Make the router GEMM's "is Transformer Engine's GEMM there?" test answer no instead of raising."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
