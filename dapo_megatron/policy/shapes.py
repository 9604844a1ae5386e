"""The published shapes of the models the examples and the GPU check use, as Hugging Face configs.

``dapo-megatron plan`` needs a model's shape, not its weights: when a config's ``model.hf_path`` folder is not on
this machine (the 32B example points at a cluster path), :func:`published_hf_config` supplies the shape by the
folder's name. The GPU check builds random models of the small shapes. The numbers are those of each model's
``config.json`` on the Hugging Face hub (Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B, Qwen/Qwen2.5-Math-1.5B, Qwen/Qwen2.5-7B,
Qwen/Qwen2.5-14B, Qwen/Qwen2.5-32B).
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2Config

_QWEN25_COMMON = dict(model_type="qwen2", hidden_act="silu", rope_theta=1000000.0, use_sliding_window=False,
                      bos_token_id=151643, eos_token_id=151643)

PUBLISHED_SHAPES: dict[str, dict] = {
    "Qwen2.5-0.5B": dict(_QWEN25_COMMON, vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(_QWEN25_COMMON, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # The math model's context is 4096 positions (rope_theta 10000): prompt + response must fit in it.
    "Qwen2.5-Math-1.5B": dict(_QWEN25_COMMON, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                              num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                              max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                              tie_word_embeddings=True),
    "Qwen2.5-7B": dict(_QWEN25_COMMON, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "Qwen2.5-14B": dict(_QWEN25_COMMON, vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "Qwen2.5-32B": dict(_QWEN25_COMMON, vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def published_name(path: str | Path) -> str | None:
    """The published model a folder is named after (``/shared/models/Qwen2.5-32B-Instruct`` → ``Qwen2.5-32B``)."""
    folder = Path(path).name.lower()
    matches = [name for name in PUBLISHED_SHAPES if folder == name.lower() or folder.startswith(name.lower() + "-")]
    return matches[0] if matches else None


def published_hf_config(name: str, **overrides):
    """A ``transformers`` ``Qwen2Config`` of a published shape; ``overrides`` change fields (e.g. fewer layers)."""

    if name not in PUBLISHED_SHAPES:
        raise KeyError(f"unknown model shape {name!r}; known: {', '.join(PUBLISHED_SHAPES)}")
    values = {key: value for key, value in {**PUBLISHED_SHAPES[name], **overrides}.items() if key != "model_type"}
    return Qwen2Config(**values)
