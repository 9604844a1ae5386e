"""What the embedded engine (``rollout.engine: embedded``) holds in rank 0's host memory, counted before it is built.

:class:`.engine.EmbeddedEngine` keeps an fp32 HF copy of the whole policy on the host and
decodes there, on CPU, whatever device the policy trains on: on a GPU run that is 4 bytes per parameter of host
memory (~131 GB for Qwen2.5-32B), next to the trainer ranks of that host. ``dapo-megatron train`` and ``eval`` check
it (:func:`dapo_megatron.run.input_checks.check_embedded_engine_memory`) before anything is built.
"""

from __future__ import annotations

from dapo_megatron.config import EmbeddedConfig
from dapo_megatron.policy.memory.gpu import layer_parameters
from dapo_megatron.policy.model_spec import ModelSpec

FP32_BYTES = 4


def embedded_parameters(spec: ModelSpec) -> int:
    """Parameters of the HF model the engine builds: every layer, the embedding, the final norm and, untied, the
    output layer (the real vocabulary: the HF model has no padding rows)."""
    vocabulary = spec.vocab_size * spec.hidden_size
    return (spec.num_layers * layer_parameters(spec, 1) + vocabulary * (1 if spec.tie_embeddings else 2)
            + spec.hidden_size)


def embedded_engine_bytes(spec: ModelSpec, settings: EmbeddedConfig) -> dict[str, int]:
    """Host bytes of the engine: the fp32 weights, the KV cache of a chunk (``max_kv_cache_mb``), and the fp32 logits
    of a chunk's rows at one step (``max_batch_rows`` × vocabulary)."""
    return {"weights": embedded_parameters(spec) * FP32_BYTES,
            "kv_cache": int(settings.max_kv_cache_mb * 2**20),
            "logits": settings.max_batch_rows * spec.vocab_size * FP32_BYTES}
