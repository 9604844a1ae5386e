"""Turn validated rows into tokenized prompts with the tokenizer's own chat template.

Each prompt is rendered with ``apply_chat_template(messages, add_generation_prompt=True)`` (so the text ends with the
assistant header the model continues from) and tokenized without extra special tokens, exactly as
``apply_chat_template(..., tokenize=True)`` does. A ``system_prompt`` (``rollout.tools.system_prompt``, as
:meth:`~dapo_megatron.config.tools.ToolsConfig.system_text` renders it) becomes the first message of every row that
has no system message of its own. Prompts longer than ``max_prompt_length`` tokens are dropped and
counted (verl's ``filter_overlong_prompts``); the count is logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

from transformers import PreTrainedTokenizerBase

from dapo_megatron.data.schema import DapoRow
from dapo_megatron.user_errors import ModelFolderError

logger = logging.getLogger(__name__)

_RENDER_CHUNK = 1024


@dataclass(frozen=True)
class PromptRecord:
    """A prompt ready for generation, with what the reward and the metrics need alongside."""

    prompt_ids: tuple[int, ...]
    ground_truth: str
    data_source: str
    index: str | int
    text: str
    extra_info: dict | None = field(default=None, compare=False)  # the row's, for reward functions (verl's)
    source_name: str | None = None  # the data.train source it was drawn from (per-source metrics)


@dataclass(frozen=True)
class PromptBuildResult:
    records: tuple[PromptRecord, ...]
    num_filtered_too_long: int
    max_prompt_length: int
    longest_kept: int


def prompt_messages(row: DapoRow, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The row's messages, after a ``system_prompt`` message unless the row has a system message of its own."""
    messages = row.messages()
    if system_prompt is None or any(message["role"] == "system" for message in messages):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def render_prompt_texts(rows: Sequence[DapoRow], tokenizer: PreTrainedTokenizerBase,
                        system_prompt: str | None = None) -> list[str]:
    """The chat-template text of each row's messages (:func:`prompt_messages`), ending with the generation prompt."""
    texts: list[str] = []
    for start in range(0, len(rows), _RENDER_CHUNK):
        chunk = rows[start : start + _RENDER_CHUNK]
        rendered = tokenizer.apply_chat_template(
            [prompt_messages(row, system_prompt) for row in chunk], add_generation_prompt=True, tokenize=False
        )
        texts.extend(rendered)
    return texts


def build_prompt_records(
    rows: Sequence[DapoRow], tokenizer: PreTrainedTokenizerBase, *, max_prompt_length: int,
    source_name: str | None = None, system_prompt: str | None = None,
) -> PromptBuildResult:
    """Tokenize every row's chat-templated prompt; keep those of at most ``max_prompt_length`` tokens, and log how
    many were dropped. ``source_name``: the ``data.train`` source the rows are from, when they are from one."""
    result = tokenize_prompts(rows, tokenizer, max_prompt_length=max_prompt_length, source_name=source_name,
                              system_prompt=system_prompt)
    if result.num_filtered_too_long:
        logger.warning(
            "filtered %d of %d prompts longer than max_prompt_length=%d tokens",
            result.num_filtered_too_long,
            len(rows),
            max_prompt_length,
        )
    logger.info("built %d prompts (longest %d tokens)", len(result.records), result.longest_kept)
    return result


def tokenize_prompts(
    rows: Sequence[DapoRow], tokenizer: PreTrainedTokenizerBase, *, max_prompt_length: int,
    source_name: str | None = None, system_prompt: str | None = None,
) -> PromptBuildResult:
    """:func:`build_prompt_records` without its log lines (a streamed source tokenizes one prompt per draw)."""
    if max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
    if tokenizer.chat_template is None:
        raise ModelFolderError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template; prompts need one "
                               f"(transformers reads it from tokenizer_config.json or chat_template.jinja)")
    texts = render_prompt_texts(rows, tokenizer, system_prompt)
    records: list[PromptRecord] = []
    num_filtered = 0
    longest_kept = 0
    for start in range(0, len(texts), _RENDER_CHUNK):
        chunk_ids = tokenizer(texts[start : start + _RENDER_CHUNK], add_special_tokens=False)["input_ids"]
        for offset, ids in enumerate(chunk_ids):
            if len(ids) > max_prompt_length:
                num_filtered += 1
                continue
            row = rows[start + offset]
            longest_kept = max(longest_kept, len(ids))
            records.append(
                PromptRecord(
                    prompt_ids=tuple(ids),
                    ground_truth=row.ground_truth,
                    data_source=row.data_source,
                    index=row.index,
                    text=texts[start + offset],
                    extra_info=row.extra_info,
                    source_name=source_name,
                )
            )
    return PromptBuildResult(
        records=tuple(records),
        num_filtered_too_long=num_filtered,
        max_prompt_length=max_prompt_length,
        longest_kept=longest_kept,
    )
