"""The tiny model's tokenizer as the trainer loads it from the model folder (run/model_source.py)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from dapo_megatron.config import TinyModelConfig, load_config
from dapo_megatron.data.tokenizer import build_tiny_tokenizer
from dapo_megatron.run.model_source import load_tokenizer
from dapo_megatron.tiny_model import tiny_qwen2_config

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def test_the_trainer_s_tokenizer_of_the_tiny_model_keeps_spaces_and_newlines(tmp_path):
    """The run's tokenizer is loaded from the model folder, next to a Qwen2 config.json: the tiny vocabulary's own
    pre-tokenizer must survive that, or "What is 6*7?" is prompted as "Whatis6*7?" and the call's end "\\n```\\n" is
    encoded as "```" (the loop then stops at a call's first fence)."""
    built = build_tiny_tokenizer(tmp_path)
    tiny_qwen2_config(TinyModelConfig(), built).save_pretrained(tmp_path)
    config = load_config(TINY)
    text = "What is 6*7?\n```\n"
    as_user_model = load_config(TINY, ["model.source=hf", f"model.hf_path={tmp_path}"])
    for loaded in (load_tokenizer(config, tmp_path), load_tokenizer(as_user_model, tmp_path)):
        assert loaded.encode(text, add_special_tokens=False) == built.encode(text, add_special_tokens=False)
        assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
    # control: the class AutoTokenizer picks from config.json loses them
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    assert auto.decode(auto.encode(text, add_special_tokens=False)) != text
