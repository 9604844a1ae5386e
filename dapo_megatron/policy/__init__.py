"""The policy: megatron-core GPTModel built from a Hugging Face config, its weights, log-probs and training step."""

from dapo_megatron.policy.model import (
    ModelSpec,
    ParallelLayoutError,
    UnsupportedModelError,
    build_model,
    model_spec_from_hf,
    padded_vocab_size,
    transformer_config,
)

__all__ = [
    "ModelSpec",
    "ParallelLayoutError",
    "UnsupportedModelError",
    "build_model",
    "model_spec_from_hf",
    "padded_vocab_size",
    "transformer_config",
]
