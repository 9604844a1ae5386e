"""Which backend runs here: :func:`select_backend`, the one place that knows every backend (the CPU one too)."""

from __future__ import annotations

import importlib.util
import logging
from typing import get_args

import torch

from dapo_megatron.backend.base import Backend
from dapo_megatron.backend.cuda import CudaLocalBackend, TransformerEngineBackend
from dapo_megatron.config import ConfigError
from dapo_megatron.config.model import Kernels
from dapo_megatron.cpu.backend import CpuBackend

TRANSFORMER_ENGINE_PACKAGE = "transformer-engine[pytorch]"

logger = logging.getLogger(__name__)


def transformer_engine_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def select_backend(kernels: Kernels = "auto", *, cuda_available: bool | None = None,
                   transformer_engine: bool | None = None) -> Backend:
    """The backend for this platform and ``model.kernels`` (see :mod:`dapo_megatron.backend`). ``cuda_available``
    and ``transformer_engine`` (importable) default to the truth; tests pass them to check the decision."""
    if kernels not in get_args(Kernels):
        raise ConfigError(f"model.kernels={kernels!r}: expected one of {', '.join(get_args(Kernels))}")
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    transformer_engine = transformer_engine_importable() if transformer_engine is None else transformer_engine
    if kernels == "transformer_engine" and not (cuda_available and transformer_engine):
        missing = "CUDA" if not cuda_available else f"the package {TRANSFORMER_ENGINE_PACKAGE} (pip install '.[gpu]')"
        raise ConfigError(f"model.kernels=transformer_engine needs Transformer Engine on CUDA, and {missing} is "
                          f"missing here: install it, or set model.kernels=auto")
    if not cuda_available:
        return CpuBackend()
    if kernels != "local" and transformer_engine:
        return TransformerEngineBackend()
    if kernels == "auto":
        logger.warning("Transformer Engine is not importable: the policy runs megatron's local layers with torch's "
                       "SDPA attention (no FP8, no fused norms or sequence parallelism). Install %s for them, or set "
                       "model.kernels=local to choose this on purpose.", TRANSFORMER_ENGINE_PACKAGE)
    return CudaLocalBackend()
