"""Rollout engines, one interface (:mod:`.engine`): the SGLang servers (:mod:`.sglang`) and the in-process engine
(:mod:`.embedded`), built from the run config by :func:`dapo_megatron.rollout.factory.build_rollout_engine`.
Shared by both: next-token sampling math (:mod:`.sampling`), the streamed-request book (:mod:`.request_book`), and
colocated placement on the trainer's GPUs (:mod:`.placement`; ``plan``'s model of a shared GPU: :mod:`.gpu_sharing`).
Importing this package loads neither engine.
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
