"""The prompts a run trains and evaluates on, from ``data.*``: DAPO-Math-17K files (+ e.g. AIME-2024 for
validation) or the synthetic arithmetic task (train split + held-out split excluded by expression)."""

from __future__ import annotations

import logging

from dapo_megatron.config import DAPOConfig
from dapo_megatron.data.dapo_math import load_dapo_math
from dapo_megatron.data.prompts import PromptRecord, build_prompt_records
from dapo_megatron.data.schema import validate_row
from dapo_megatron.data.synthetic import SyntheticSplit, make_split

logger = logging.getLogger(__name__)


def synthetic_split(config: DAPOConfig) -> SyntheticSplit:
    s = config.data.synthetic
    return make_split(s.seed, s.num_train, s.num_heldout)


def _synthetic_rows(config: DAPOConfig, split_name: str) -> list:
    split = synthetic_split(config)
    rows = split.train_rows() if split_name == "train" else split.heldout_rows()
    source = "synthetic/train" if split_name == "train" else "synthetic/heldout"
    return [validate_row(r, source=source, row=i, integer_answers=True) for i, r in enumerate(rows)]


def _file_rows(config: DAPOConfig, paths: list[str]) -> list:
    d = config.data
    return [row for path in paths
            for row in load_dapo_math(path, integer_answers=d.integer_answers, on_bad_row=d.on_bad_row).rows]


def train_prompts(config: DAPOConfig, tokenizer) -> tuple[PromptRecord, ...]:
    """The training prompts (chat-templated, tokenized; those over ``data.max_prompt_length`` dropped, with a warning)."""
    d = config.data
    rows = _synthetic_rows(config, "train") if d.source == "synthetic" else _file_rows(config, d.train_files)
    train = build_prompt_records(rows, tokenizer, max_prompt_length=d.max_prompt_length)
    if train.num_filtered_too_long:
        logger.warning("dropped %d training prompts longer than data.max_prompt_length=%d",
                       train.num_filtered_too_long, d.max_prompt_length)
    if not train.records:
        raise ValueError("no training prompt is left after length filtering (data.max_prompt_length too small?)")
    return train.records


def eval_prompts(config: DAPOConfig, tokenizer) -> tuple[PromptRecord, ...]:
    """The validation prompts (may hold several data_sources; metrics are reported per source), at most
    ``eval.max_problems``; empty when there are none."""
    d = config.data
    rows = _synthetic_rows(config, "heldout") if d.source == "synthetic" else _file_rows(config, d.val_files)
    if not rows:
        return ()
    records = build_prompt_records(rows, tokenizer, max_prompt_length=d.max_prompt_length).records
    return records if config.eval.max_problems is None else records[: config.eval.max_problems]
