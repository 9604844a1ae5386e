"""Where the policy's first weights come from: an HF folder, either the user's or one made here.

``model.source = hf``: the user's folder (``model.hf_path``), e.g. Qwen2.5-32B, used as is.

``model.source = tiny``: rank 0 builds the tiny tokenizer (trained locally), a small random Qwen2 config and, when
``warm_start.enabled``, runs the supervised warm-start; the result is written to ``<run_dir>/initial_model`` as an
ordinary HF folder (atomically, with a COMPLETE marker, so a resumed run reuses it). From there on the tiny run takes
exactly the path of a real model: HF safetensors → Megatron shards → RL.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config

from dapo_megatron.config import DAPOConfig, TinyModelConfig

logger = logging.getLogger(__name__)


@dataclass
class InitialModel:
    hf_dir: Path
    tokenizer_dir: Path
    warm_start_report: dict | None = None


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


def prepare_initial_model(config: DAPOConfig, run_dir: Path) -> InitialModel:
    """Rank 0 only. Returns the HF folder the policy is loaded from."""
    if config.model.source == "hf":
        hf_dir = Path(config.model.hf_path)
        if not (hf_dir / "config.json").exists():
            raise FileNotFoundError(f"model.hf_path={hf_dir} has no config.json")
        return InitialModel(hf_dir, Path(config.model.tokenizer_path or hf_dir))

    out = run_dir / "initial_model"
    if (out / "COMPLETE").exists():
        report = json.loads((out / "warm_start.json").read_text()) if (out / "warm_start.json").exists() else None
        return InitialModel(out, out, report)
    tmp = run_dir / "initial_model.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    from transformers import AutoModelForCausalLM

    from dapo_megatron.data.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(tmp)
    hf_config = tiny_qwen2_config(config.model.tiny, tokenizer)
    torch.manual_seed(config.trainer.seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    report = None
    if config.warm_start.enabled:
        report = _run_warm_start(config, model, tokenizer, hf_config)
        (tmp / "warm_start.json").write_text(json.dumps(report, indent=2))
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "COMPLETE").write_text("ok\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return InitialModel(out, out, report)


def _run_warm_start(config: DAPOConfig, model, tokenizer, hf_config) -> dict:
    from dapo_megatron.data.prompts import build_prompt_records
    from dapo_megatron.data.schema import validate_row
    from dapo_megatron.rollout.embedded import EmbeddedEngine
    from dapo_megatron.trainer.warm_start import supervised_warm_start
    from dapo_megatron.trainer.task import synthetic_split

    split = synthetic_split(config)
    n_val = min(200, len(split.train) // 10)
    # The validation slice comes from the training problems: the held-out set stays untouched until RL is scored.
    val_problems, sft_problems = split.train[:n_val], split.train[n_val:]

    def records(problems):
        rows = [validate_row(p.to_row(i, "train"), source="synthetic", row=i, integer_answers=True)
                for i, p in enumerate(problems)]
        return build_prompt_records(rows, tokenizer, max_prompt_length=config.data.max_prompt_length).records

    engine = EmbeddedEngine(hf_config)
    result = supervised_warm_start(
        model, tokenizer,
        train_records=records(sft_problems), train_solutions=[p.solution for p in sft_problems],
        val_records=records(val_problems), engine=engine, config=config.warm_start,
        max_new_tokens=config.rollout.max_response_length, seed=config.trainer.seed,
    )
    engine.shutdown()
    logger.info("warm-start: %d steps, validation greedy accuracy %.3f, %.0f s",
                result.steps, result.val_accuracy, result.seconds)
    return {"steps": result.steps, "val_accuracy": result.val_accuracy, "seconds": result.seconds,
            "history": result.history}


def load_tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(str(path))
