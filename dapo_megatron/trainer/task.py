"""The prompts a run trains and evaluates on, from ``data.*``: DAPO-Math-17K files (+ e.g. AIME-2024 for
validation) or the synthetic arithmetic task (train split + held-out split excluded by expression).

A data file is read once per process (:func:`load_data_file`): the input checks before a run starts read it and the
trainer then uses what they read.
"""

from __future__ import annotations

import functools
import logging
import os

from dapo_megatron.config import DAPOConfig
from dapo_megatron.data.dapo_math import DapoMathData, load_dapo_math
from dapo_megatron.data.prompts import PromptRecord, build_prompt_records
from dapo_megatron.data.schema import validate_row
from dapo_megatron.data.synthetic import SyntheticSplit, make_split
from dapo_megatron.trainer.input_checks import check_enough_prompts, train_files_summary

logger = logging.getLogger(__name__)


def synthetic_split(config: DAPOConfig) -> SyntheticSplit:
    s = config.data.synthetic
    return make_split(s.seed, s.num_train, s.num_heldout)


def _synthetic_rows(config: DAPOConfig, split_name: str) -> list:
    split = synthetic_split(config)
    rows = split.train_rows() if split_name == "train" else split.heldout_rows()
    source = "synthetic/train" if split_name == "train" else "synthetic/heldout"
    return [validate_row(r, source=source, row=i, integer_answers=True) for i, r in enumerate(rows)]


def load_data_file(config: DAPOConfig, path: str) -> DapoMathData:
    """``path`` read and validated with the ``data.*`` settings (a :class:`~dapo_megatron.user_errors.DataError`
    naming the file, and the row, when it cannot be used); the same file unchanged is read only once."""
    d = config.data
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        stamp = None  # missing (the loader says so) or a hub name
    return _load_data_file(path, stamp, d.integer_answers, d.on_bad_row)


@functools.lru_cache(maxsize=8)
def _load_data_file(path: str, stamp: int | None, integer_answers: bool, on_bad_row: str) -> DapoMathData:
    return load_dapo_math(path, integer_answers=integer_answers, on_bad_row=on_bad_row)


def _file_rows(config: DAPOConfig, paths: list[str]) -> list:
    return [row for path in paths for row in load_data_file(config, path).rows]


def train_prompts(config: DAPOConfig, tokenizer) -> tuple[PromptRecord, ...]:
    """The training prompts (chat-templated, tokenized; those over ``data.max_prompt_length`` dropped, with a warning)."""
    d = config.data
    rows = _synthetic_rows(config, "train") if d.source == "synthetic" else _file_rows(config, d.train_files)
    train = build_prompt_records(rows, tokenizer, max_prompt_length=d.max_prompt_length)
    if train.num_filtered_too_long:
        logger.warning("dropped %d training prompts longer than data.max_prompt_length=%d",
                       train.num_filtered_too_long, d.max_prompt_length)
    source = "data.synthetic.num_train" if d.source == "synthetic" else train_files_summary(config)
    check_enough_prompts(config, len(train.records),
                         f"{source}; {train.num_filtered_too_long} of them longer than data.max_prompt_length="
                         f"{d.max_prompt_length} tokens" if train.num_filtered_too_long else source)
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
