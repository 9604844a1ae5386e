"""Hugging Face ↔ megatron-core checkpoint conversion at any TP/PP (and EP for mixture-of-experts models).

* ``python -m checkpoint_tools.hf_to_megatron --hf-dir DIR --out DIR --tp N --pp M [--ep E]`` — an HF folder
  becomes a megatron-core distributed checkpoint (``<out>/model/``, the trainer's format, loadable at any TP/PP)
  plus the config and tokenizer (``<out>/hf/``).
* ``python -m checkpoint_tools.megatron_to_hf --ckpt DIR --out DIR`` — a distributed checkpoint (the trainer's or
  the one above) becomes an HF folder (sharded safetensors + index, config, generation config, tokenizer).

Both check their input before starting any rank, stream tensors (no rank holds the whole model unless it is a world
of one) and write their output atomically. Importing this package is cheap: megatron and transformers are imported
by the functions that need them.
"""

from checkpoint_tools.errors import ConversionError

__all__ = ["ConversionError", "convert_hf_to_megatron", "convert_megatron_to_hf"]


def __getattr__(name: str):
    """The converters, imported on first use (eager imports here would make ``python -m`` warn about re-import)."""
    if name == "convert_hf_to_megatron":
        from checkpoint_tools.hf_to_megatron import convert_hf_to_megatron

        return convert_hf_to_megatron
    if name == "convert_megatron_to_hf":
        from checkpoint_tools.megatron_to_hf import convert_megatron_to_hf

        return convert_megatron_to_hf
    raise AttributeError(f"module 'checkpoint_tools' has no attribute {name!r}")
