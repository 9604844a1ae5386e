"""Which backend runs here: :func:`select_backend`, the one place that knows every backend (the CPU one too)."""

from __future__ import annotations

import importlib.util
import logging
from typing import get_args

import torch

from dapo_megatron.backend.base import Backend
from dapo_megatron.cuda.backend import CudaLocalBackend, TransformerEngineBackend
from dapo_megatron.config import ConfigError
from dapo_megatron.config.model import Kernels
from dapo_megatron.cpu.backend import CpuBackend

TRANSFORMER_ENGINE_PACKAGE = "transformer-engine[pytorch]"

logger = logging.getLogger(__name__)


def transformer_engine_problem() -> str | None:
    """Why Transformer Engine's PyTorch layers cannot be used here, or None when they import.

    The installed package alone says nothing: the ``transformer_engine`` meta package imports even when its PyTorch
    extension does not (it swallows that ImportError, e.g. a missing ``libcudnn`` or a torch it was not built
    against), and megatron-core then silently substitutes mocks for its layers. So ``transformer_engine.pytorch`` is
    imported, and its error is what a run reports."""
    if importlib.util.find_spec("transformer_engine") is None:
        return f"the package {TRANSFORMER_ENGINE_PACKAGE} is not installed (pip install '.[gpu]')"
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as error:  # noqa: BLE001 - any failure to load the extension means no TE layers
        return f"transformer_engine.pytorch does not import ({type(error).__name__}: {error})"
    return None


def transformer_engine_importable() -> bool:
    return transformer_engine_problem() is None


def select_backend(kernels: Kernels = "auto", *, cuda_available: bool | None = None,
                   transformer_engine: bool | None = None) -> Backend:
    """The backend for this platform and ``model.kernels`` (see :mod:`dapo_megatron.backend`). ``cuda_available``
    and ``transformer_engine`` (its PyTorch layers import) default to the truth; tests pass them to check the
    decision."""
    if kernels not in get_args(Kernels):
        raise ConfigError(f"model.kernels={kernels!r}: expected one of {', '.join(get_args(Kernels))}")
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if transformer_engine is None:
        problem = transformer_engine_problem() if cuda_available else None
    else:
        problem = None if transformer_engine else f"the package {TRANSFORMER_ENGINE_PACKAGE} is not installed"
    if kernels == "transformer_engine" and (not cuda_available or problem):
        missing = "CUDA is missing here" if not cuda_available else problem
        raise ConfigError(f"model.kernels=transformer_engine needs Transformer Engine on CUDA, and {missing}: "
                          f"install it, or set model.kernels=auto")
    if not cuda_available:
        return CpuBackend()
    if kernels != "local" and problem is None:
        return TransformerEngineBackend()
    if kernels == "auto":
        logger.warning("Transformer Engine cannot be used (%s): the policy runs megatron's local layers with torch's "
                       "SDPA attention (no FP8, no fused norms or sequence parallelism). Install %s for them, or set "
                       "model.kernels=local to choose this on purpose.", problem, TRANSFORMER_ENGINE_PACKAGE)
    return CudaLocalBackend()
