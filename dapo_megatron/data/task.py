"""The prompts a run trains and evaluates on, from ``data.*``: DAPO-Math-17K files (+ e.g. AIME-2024 for
validation), a mixture of training sources (``data.train``: files or folders, each with a weight;
:mod:`dapo_megatron.data.mixture`), or the synthetic arithmetic task (train split + held-out split excluded by
expression). :func:`train_sampler` is what the trainer draws its prompts from.

A data file (or a folder read at start) is read once per process (:func:`load_data_file`): the input checks before a
run starts read it and the trainer then uses what they read.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from dapo_megatron.config import ConfigError, DAPOConfig, TrainSourceConfig
from dapo_megatron.data.dapo_math import DapoMathData, load_dapo_math
from dapo_megatron.data.folders import StreamedPrompts, check_first_rows, folder_dataset
from dapo_megatron.data.mixture import MixtureSampler, MixtureSource
from dapo_megatron.data.prompts import PromptRecord, build_prompt_records
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.data.schema import validate_row
from dapo_megatron.data.synthetic import SyntheticSplit, make_split
from dapo_megatron.data.synthetic_scratchpad import ScratchpadTaskConfig, make_scratchpad_split
from dapo_megatron.data.synthetic_tools import make_tool_split
from dapo_megatron.user_errors import DataError

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)


def synthetic_split(config: DAPOConfig) -> SyntheticSplit:
    s = config.data.synthetic
    if s.mode == "scratchpad":
        task = ScratchpadTaskConfig(min_terms=s.scratchpad.min_terms, max_terms=s.scratchpad.max_terms)
        return make_scratchpad_split(s.seed, s.num_train, s.num_heldout, task)
    split = make_tool_split if s.mode == "tools" else make_split
    return split(s.seed, s.num_train, s.num_heldout)


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
        stamp = os.stat(path).st_mtime_ns  # a folder's changes with its shards' names
    except OSError:
        stamp = None  # missing (the loader says so) or a hub name
    return _load_data_file(path, stamp, d.integer_answers, d.on_bad_row)


@functools.lru_cache(maxsize=8)
def _load_data_file(path: str, stamp: int | None, integer_answers: bool, on_bad_row: str) -> DapoMathData:
    return load_dapo_math(path, integer_answers=integer_answers, on_bad_row=on_bad_row)


def _file_rows(config: DAPOConfig, paths: list[str]) -> list:
    return [row for path in paths for row in load_data_file(config, path).rows]


def train_prompts(config: DAPOConfig, tokenizer) -> tuple[PromptRecord, ...]:
    """The training prompts (chat-templated, tokenized; those over ``data.max_prompt_length`` dropped, with a
    warning)."""
    d = config.data
    rows = _synthetic_rows(config, "train") if d.source == "synthetic" else _file_rows(config, d.train_files)
    train = build_prompt_records(rows, tokenizer, max_prompt_length=d.max_prompt_length,
                                 system_prompt=config.rollout.tools.system_text())
    if train.num_filtered_too_long:
        logger.warning("dropped %d training prompts longer than data.max_prompt_length=%d",
                       train.num_filtered_too_long, d.max_prompt_length)
    source = "data.synthetic.num_train" if d.source == "synthetic" else train_files_summary(config)
    check_enough_prompts(config, len(train.records),
                         f"{source}; {train.num_filtered_too_long} of them longer than data.max_prompt_length="
                         f"{d.max_prompt_length} tokens" if train.num_filtered_too_long else source)
    return train.records


def train_sampler(config: DAPOConfig, tokenizer) -> PromptSampler | MixtureSampler:
    """What the run draws its training prompts from: the ``data.train`` mixture, or one pool (``data.train_files``,
    the synthetic task) in :class:`PromptSampler`'s order."""
    t = config.trainer
    if not config.data.train:
        return PromptSampler(train_prompts(config, tokenizer), batch_size=t.train_batch_size, seed=t.seed)
    d = config.data
    sources = []
    for index, (source, name, opened) in enumerate(open_train_sources(config)):
        if isinstance(opened, DapoMathData):
            prompts = build_prompt_records(opened.rows, tokenizer, max_prompt_length=d.max_prompt_length,
                                           source_name=name, system_prompt=config.rollout.tools.system_text()).records
            if not prompts:
                raise DataError(f"data.train[{index}]: every prompt of {source.path} is longer than "
                                f"data.max_prompt_length={d.max_prompt_length} tokens")
        else:
            prompts = StreamedPrompts(source.path, opened, tokenizer, max_prompt_length=d.max_prompt_length,
                                      integer_answers=d.integer_answers, on_bad_row=d.on_bad_row, source_name=name,
                                      system_prompt=config.rollout.tools.system_text())
        sources.append(MixtureSource(name=name, weight=source.weight, prompts=prompts))
    return MixtureSampler(sources, seed=t.seed)


def open_train_sources(config: DAPOConfig) -> list[tuple[TrainSourceConfig, str, DapoMathData | datasets.Dataset]]:
    """Each ``data.train`` source with its name and its rows: read at start (validated, deduplicated), or — a folder
    of more than ``data.stream_above_rows`` rows — opened to be read as drawn (its arrow dataset, first rows
    checked). Names (``name``, by default the first row's data_source) must differ: per-source metrics and the
    checkpoint's sampler position are keyed by them."""
    d = config.data
    opened_sources = []
    names: list[str] = []
    for index, source in enumerate(d.train):
        dataset = folder_dataset(source.path) if Path(source.path).is_dir() else None
        if dataset is not None and len(dataset) > d.stream_above_rows:
            check_first_rows(dataset, source.path, integer_answers=d.integer_answers, on_bad_row=d.on_bad_row)
            opened, first = dataset, str(dataset[0]["data_source"])
        else:
            opened = load_data_file(config, source.path)
            if not opened.rows:
                raise DataError(f"data.train[{index}]: {source.path} has no valid rows")
            first = opened.rows[0].data_source
        name = source.name or first
        if name in names:
            raise ConfigError(f"data.train[{index}].name: {name!r} is also data.train[{names.index(name)}]'s name (by "
                              f"default a source is named after its rows' data_source): give each source a name")
        names.append(name)
        opened_sources.append((source, name, opened))
    return opened_sources


def check_training_data(config: DAPOConfig) -> None:
    """Every data file and ``data.train`` source read and checked, before the run starts."""
    d = config.data
    if d.source != "dapo_math":
        return
    for path in [*d.train_files, *d.val_files]:
        load_data_file(config, path)
    open_train_sources(config)


def eval_prompts(config: DAPOConfig, tokenizer) -> tuple[PromptRecord, ...]:
    """The validation prompts (may hold several data_sources; metrics are reported per source), at most
    ``eval.max_problems``; empty when there are none."""
    d = config.data
    rows = _synthetic_rows(config, "heldout") if d.source == "synthetic" else _file_rows(config, d.val_files)
    if not rows:
        return ()
    records = build_prompt_records(rows, tokenizer, max_prompt_length=d.max_prompt_length,
                                   system_prompt=config.rollout.tools.system_text()).records
    return records if config.eval.max_problems is None else records[: config.eval.max_problems]


def train_files_summary(config: DAPOConfig) -> str:
    """``data.train_files: a.jsonl: 10000 rows, deduplicated to 1 unique prompt`` — what the files gave."""
    parts = []
    for path in config.data.train_files:
        report = load_data_file(config, path).report
        part = f"{path}: {report.total_rows} rows"
        if report.duplicate_rows:
            n = report.unique_prompts
            part += f", deduplicated to {n} unique prompt{'' if n == 1 else 's'}"
        if report.skipped_rows:
            part += f", {report.skipped_rows} malformed ones skipped"
        parts.append(part)
    return "data.train_files: " + "; ".join(parts)


def check_enough_prompts(config: DAPOConfig, count: int, source: str) -> None:
    """Refuse a batch that the training prompts cannot fill: every step draws ``trainer.train_batch_size`` distinct
    prompts (with dynamic sampling, ``algorithm.gen_batch_size`` per generation round). ``source``: where ``count``
    comes from, for the message."""
    t, a = config.trainer, config.algorithm
    key, need = "trainer.train_batch_size", t.train_batch_size
    if a.dynamic_sampling and a.gen_batch_size > need:
        key, need = "algorithm.gen_batch_size", a.gen_batch_size
    if count < need:
        raise ConfigError(f"{key}={need} needs {need} distinct training prompts per draw, but there "
                          f"{'is only 1' if count == 1 else f'are only {count}'} ({source})")
