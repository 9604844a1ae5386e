"""Rollout engines: the interface (:mod:`.engine`), the in-process engine (:mod:`.embedded`).

The SGLang engine lives in :mod:`dapo_megatron.rollout.sglang_engine` and is imported from there explicitly, so that
importing this package never pulls in SGLang or its HTTP stack.
"""

from dapo_megatron.rollout.embedded import EmbeddedEngine
from dapo_megatron.rollout.engine import (
    EngineHealth,
    FinishedRequest,
    GenerationRequest,
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
)

__all__ = ["RolloutEngine", "SamplingParams", "Sample", "EngineHealth", "RolloutError", "EmbeddedEngine",
           "GenerationRequest", "FinishedRequest"]
