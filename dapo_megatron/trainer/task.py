"""The prompts a run trains and evaluates on, from ``data.*``: DAPO-Math-17K files (+ e.g. AIME-2024 for
validation) or the synthetic arithmetic task (train split + held-out split excluded by expression)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dapo_megatron.config import DAPOConfig
from dapo_megatron.data.dapo_math import load_dapo_math
from dapo_megatron.data.prompts import PromptRecord, build_prompt_records
from dapo_megatron.data.schema import validate_row
from dapo_megatron.data.synthetic import SyntheticSplit, make_split

logger = logging.getLogger(__name__)


@dataclass
class Task:
    train: tuple[PromptRecord, ...]
    eval: tuple[PromptRecord, ...]  # may hold several data_sources; metrics are reported per source


def synthetic_split(config: DAPOConfig) -> SyntheticSplit:
    s = config.data.synthetic
    return make_split(s.seed, s.num_train, s.num_heldout)


def build_task(config: DAPOConfig, tokenizer) -> Task:
    d = config.data
    if d.source == "synthetic":
        split = synthetic_split(config)
        train_rows = [validate_row(r, source="synthetic/train", row=i, integer_answers=True)
                      for i, r in enumerate(split.train_rows())]
        eval_rows = [validate_row(r, source="synthetic/heldout", row=i, integer_answers=True)
                     for i, r in enumerate(split.heldout_rows())]
    else:
        train_rows = [row for path in d.train_files
                      for row in load_dapo_math(path, integer_answers=d.integer_answers, on_bad_row=d.on_bad_row).rows]
        eval_rows = [row for path in d.val_files
                     for row in load_dapo_math(path, integer_answers=d.integer_answers, on_bad_row=d.on_bad_row).rows]
    train = build_prompt_records(train_rows, tokenizer, max_prompt_length=d.max_prompt_length)
    evals = build_prompt_records(eval_rows, tokenizer, max_prompt_length=d.max_prompt_length) if eval_rows else None
    if train.num_filtered_too_long:
        logger.warning("dropped %d training prompts longer than data.max_prompt_length=%d",
                       train.num_filtered_too_long, d.max_prompt_length)
    if not train.records:
        raise ValueError("no training prompt is left after length filtering (data.max_prompt_length too small?)")
    eval_records = evals.records if evals else ()
    if config.eval.max_problems is not None:
        eval_records = eval_records[: config.eval.max_problems]
    return Task(train=train.records, eval=eval_records)
