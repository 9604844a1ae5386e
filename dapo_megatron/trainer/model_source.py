"""Where the policy's first weights come from: always an HF folder, which the trainer loads like any user model.

``model.source = hf``: the user's folder (``model.hf_path``), e.g. Qwen2.5-32B, used as is.
``model.source = tiny``: ``<run_dir>/initial_model``, made once by :func:`dapo_megatron.tiny_model.prepare_tiny_model`
(rank 0 builds it, the other ranks wait; a resumed run finds it complete and reuses it).
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from dapo_megatron.config import ConfigError, DAPOConfig
from dapo_megatron.hf_format import CONFIG_FILE
from dapo_megatron.rank_zero import run_on_rank0
from dapo_megatron.tiny_model.build import COMPLETE_MARKER


def tiny_model_dir(config: DAPOConfig) -> Path:
    return Path(config.trainer.run_dir) / "initial_model"


def initial_model_dir(config: DAPOConfig) -> Path:
    """The HF folder the run starts from, which must exist already (no collectives)."""
    if config.model.source == "hf":
        hf_dir = Path(config.model.hf_path)
        if not (hf_dir / CONFIG_FILE).exists():
            raise ConfigError(f"model.hf_path: {hf_dir} has no {CONFIG_FILE}")
        return hf_dir
    tiny_dir = tiny_model_dir(config)
    if not (tiny_dir / COMPLETE_MARKER).exists():
        raise ConfigError(f"model.source: the tiny model {tiny_dir} has not been prepared "
                          f"(`dapo-megatron prepare-tiny` or `dapo-megatron train` with this config makes it)")
    return tiny_dir


def prepare_initial_model(config: DAPOConfig) -> Path:
    """:func:`initial_model_dir`, made first when ``model.source = tiny``. Every rank calls it (after
    ``init_distributed`` when there are several): rank 0 prepares, the others wait, and a failure on rank 0 is raised
    on every rank."""
    if config.model.source == "tiny":
        from dapo_megatron.tiny_model import prepare_tiny_model

        run_on_rank0(lambda: prepare_tiny_model(config, tiny_model_dir(config)), what="preparing the tiny model")
    return initial_model_dir(config)


def load_tokenizer(config: DAPOConfig, model_dir: str | Path):
    """``model.tokenizer_path`` for a user's model when given; else the tokenizer in the model folder."""
    custom = config.model.tokenizer_path if config.model.source == "hf" else None
    return AutoTokenizer.from_pretrained(str(custom or model_dir))
