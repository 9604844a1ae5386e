"""Training data in a folder: an HF ``datasets`` folder (written by ``save_to_disk``; ``load_from_disk`` reads it) or
a folder of parquet / jsonl shards (every ``*.parquet`` or every ``*.jsonl`` in it, in name order), in the
DAPO-Math-17K (verl) schema. Both open as one memory-mapped arrow table (:func:`folder_dataset`): rows stay on disk
until read. (jsonl shards are converted once, on their first opening, into HF ``datasets``' arrow cache,
``~/.cache/huggingface/datasets`` or ``HF_DATASETS_CACHE``; parquet shards likewise.)

A folder of at most ``data.stream_above_rows`` rows is read like a file, every row validated and deduplicated at
start (:func:`dapo_megatron.data.dapo_math.load_dapo_math`). A larger one is read as its prompts are drawn
(:class:`StreamedPrompts`): a row is validated, chat-templated and tokenized when the sampler picks it, with no
deduplication; one that is malformed (``data.on_bad_row: skip``) or longer than ``data.max_prompt_length`` is
skipped then and counted. What can be checked at start without reading every row is: that it opens, that its columns
include the schema's, and that its first rows are valid.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from dapo_megatron.data.prompts import PromptRecord, tokenize_prompts
from dapo_megatron.data.schema import RowValidationError, validate_row
from dapo_megatron.user_errors import DataError

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
CHECKED_AT_START = 64  # rows of a streamed folder validated before the run starts
SHARD_SUFFIXES = (".parquet", ".jsonl")


def folder_dataset(path: str | Path) -> datasets.Dataset:
    """The folder as one arrow ``Dataset`` (see the module docstring); a :class:`DataError` naming it otherwise."""
    import datasets  # arrow: only folder sources need it

    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path}: no such folder")
    try:
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            dataset = datasets.load_from_disk(str(path))
            if isinstance(dataset, datasets.DatasetDict):
                if "train" not in dataset:
                    raise DataError(f"{path}: a DatasetDict without a 'train' split (it has {sorted(dataset)})")
                dataset = dataset["train"]
        else:
            dataset = _shards(path)
    except DataError:
        raise
    except Exception as error:  # arrow's and datasets' errors name no folder
        raise DataError(f"{path}: not a readable dataset folder ({type(error).__name__}: {error})") from error
    missing = [c for c in REQUIRED_COLUMNS if c not in dataset.column_names]
    if missing:
        raise DataError(f"{path}: no column {', '.join(missing)} (it has {', '.join(dataset.column_names)}): "
                        f"rows must follow the DAPO-Math-17K schema")
    return dataset


def _shards(path: Path) -> datasets.Dataset:
    import datasets

    by_suffix = {suffix: sorted(p for p in path.iterdir() if p.suffix == suffix) for suffix in SHARD_SUFFIXES}
    kinds = [suffix for suffix, files in by_suffix.items() if files]
    if len(kinds) != 1:
        found = "both parquet and jsonl shards" if kinds else "no *.parquet or *.jsonl shards"
        raise DataError(f"{path}: {found}; a shard folder holds one kind (or save_to_disk's files)")
    files = [str(p) for p in by_suffix[kinds[0]]]
    return datasets.Dataset.from_parquet(files) if kinds[0] == ".parquet" else datasets.Dataset.from_json(files)


def check_first_rows(dataset: datasets.Dataset, path: str | Path, *, integer_answers: bool,
                     on_bad_row: str) -> None:
    """Validate a streamed folder's first rows (a :class:`RowValidationError` naming the row, unless skipped)."""
    for row in range(min(CHECKED_AT_START, len(dataset))):
        try:
            validate_row(dataset[row], source=str(path), row=row, integer_answers=integer_answers)
        except RowValidationError:
            if on_bad_row == "error":
                raise


class StreamedPrompts:
    """A large folder's prompts, made when drawn: ``prompts[i]`` is row ``i`` of ``dataset`` (the folder's,
    :func:`folder_dataset`) as a :class:`PromptRecord`, or None when the row is skipped (malformed under
    ``on_bad_row: skip``, or too long)."""

    def __init__(self, path: str | Path, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, *,
                 max_prompt_length: int, integer_answers: bool, on_bad_row: str, source_name: str | None = None,
                 system_prompt: str | None = None):
        self.path = str(path)
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.integer_answers = integer_answers
        self.on_bad_row = on_bad_row
        self.source_name = source_name
        self.system_prompt = system_prompt  # data/prompts.py
        self._warned = 0
        logger.info("%s: %d rows, read as drawn (more than data.stream_above_rows)", self.path, len(dataset))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> PromptRecord | None:
        try:
            row = validate_row(self.dataset[index], source=self.path, row=index, integer_answers=self.integer_answers)
        except RowValidationError as error:
            if self.on_bad_row == "error":
                raise
            self._skip(f"malformed: {error}")
            return None
        built = tokenize_prompts([row], self.tokenizer, max_prompt_length=self.max_prompt_length,
                                 source_name=self.source_name, system_prompt=self.system_prompt)
        if not built.records:
            self._skip(f"row {index} is longer than data.max_prompt_length={self.max_prompt_length} tokens")
            return None
        return built.records[0]

    def _skip(self, why: str) -> None:
        self._warned += 1
        if self._warned <= 10:
            logger.warning("%s: skipping a drawn prompt: %s", self.path, why)
