"""What a Hugging Face model folder holds besides its weights, and the names of its weight files.

A folder that ``transformers`` and SGLang load holds the weights (``model.safetensors``, or shards named in
``model.safetensors.index.json``) and *side files*: the config, the generation config and the tokenizer. Every
copy of a model this project makes — a checkpoint's ``hf/``, a converted folder, a disk-transport snapshot —
carries the side files of :data:`SIDE_FILES`, copied by :func:`copy_side_files`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import AutoConfig

from dapo_megatron.user_errors import ModelFolderError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# Everything besides the weights that an HF folder needs to be loaded and used for generation.
SIDE_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


class HFFormatError(ModelFolderError, ValueError):
    """An HF model folder is unusable: a weight file missing, truncated or corrupted, or tensors that do not fit
    the model. The message names the file and tensors."""


def copy_side_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy the :data:`SIDE_FILES` present in ``src_dir`` into ``dst_dir`` (created); return their names."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in SIDE_FILES:
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dst_dir / name)
            copied.append(name)
    return copied


def load_hf_config(model_dir: str | Path):
    """The ``transformers`` config of a local HF model folder (no hub access)."""

    model_dir = Path(model_dir)
    if not (model_dir / CONFIG_FILE).is_file():
        raise HFFormatError(f"{model_dir} has no {CONFIG_FILE}: not a Hugging Face model folder")
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise HFFormatError(f"{model_dir / CONFIG_FILE} cannot be read by transformers: {exc}") from None
