"""``model.tiny`` + ``warm_start`` → an HF folder (config.json, model.safetensors, tokenizer files, warm_start.json).

The folder is built under ``<out>.tmp`` and renamed into place with a ``COMPLETE`` marker inside, so a run killed
half-way leaves nothing that looks finished, and a complete folder is reused as is (a resumed run does not warm-start
again). Everything is seeded by ``trainer.seed``: the same config gives the same folder, byte for byte.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from dapo_megatron.config import ConfigError, DAPOConfig, TinyModelConfig
from dapo_megatron.data.tokenizer import build_tiny_tokenizer
from dapo_megatron.tiny_model.warm_start import warm_start_on_synthetic_task

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
WARM_START_REPORT = "warm_start.json"


def tiny_qwen2_config(tiny: TinyModelConfig, tokenizer) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        intermediate_size=tiny.intermediate_size,
        max_position_embeddings=tiny.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": tiny.rope_theta},
        tie_word_embeddings=tiny.tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def prepare_tiny_model(config: DAPOConfig, out_dir: str | Path) -> Path:
    """Build (or reuse, when complete) the tiny model of ``config`` at ``out_dir``; one process, no collectives."""
    if config.model.source != "tiny":
        raise ConfigError(f"model.source: the tiny model is built only for model.source = tiny, "
                          f"got {config.model.source!r}")
    out = Path(out_dir)
    if (out / COMPLETE_MARKER).exists():
        logger.info("reusing the tiny model at %s", out)
        return out
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)



    tokenizer = build_tiny_tokenizer(tmp)
    hf_config = tiny_qwen2_config(config.model.tiny, tokenizer)
    torch.manual_seed(config.trainer.seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    if config.warm_start.enabled:
        report = warm_start_on_synthetic_task(config, model, tokenizer, hf_config)
        (tmp / WARM_START_REPORT).write_text(json.dumps(report, indent=2))
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / COMPLETE_MARKER).write_text("ok\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    logger.info("tiny model written to %s", out)
    return out
