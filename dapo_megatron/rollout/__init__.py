"""Rollout engines: the interface every engine implements (:mod:`.engine`).

The engines are imported from their own modules — :mod:`dapo_megatron.rollout.embedded` (in-process) and
:mod:`dapo_megatron.rollout.sglang_engine` (SGLang servers) — or built from the run config by
:func:`dapo_megatron.rollout.factory.build_rollout_engine`, so that importing this package loads neither.
"""

from dapo_megatron.rollout.engine import (
    EngineHealth,
    FinishedRequest,
    GenerationRequest,
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
)

__all__ = ["RolloutEngine", "SamplingParams", "Sample", "EngineHealth", "RolloutError", "GenerationRequest",
           "FinishedRequest"]
