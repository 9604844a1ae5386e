"""The DAPO-Math-17K row schema and per-row validation.

A row, as published in ``BytedTsinghua-SIA/DAPO-Math-17k``::

    {"data_source": "math_dapo",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "MATH",
     "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
     "extra_info": {"index": "<uuid string>"}}

``validate_row`` turns one raw mapping into a typed :class:`DapoRow` or raises :class:`RowValidationError`
naming the file, the row and the offending field. Required: ``data_source`` (non-empty str), ``prompt`` (non-empty
list of ``{role, content}`` with string role/content and at least one user message) and
``reward_model.ground_truth`` (non-empty str, or an int which is converted to its decimal string). Optional, with
defaults when absent: ``ability`` (""), ``reward_model.style`` (""), ``extra_info.index`` (the row number). The whole
``extra_info`` mapping is kept (with ``index`` filled in): reward functions with verl's signature receive it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NoReturn

from dapo_megatron.user_errors import DataError

CHAT_ROLES = ("system", "user", "assistant")
INTEGER_PATTERN = re.compile(r"-?\d+")
FailFn = Callable[[str, str], NoReturn]


class RowValidationError(DataError, ValueError):
    """A malformed row: says which file, which row (0-based, plus ``extra_info.index`` when known) and which field."""

    def __init__(self, source: str, row: int, field: str, problem: str, index: str | int | None = None):
        self.source = source
        self.row = row
        self.field = field
        self.problem = problem
        self.index = index
        where = f"row {row}" if index is None else f"row {row} (extra_info.index={index!r})"
        super().__init__(f"{source}: {where}: field '{field}': {problem}")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class DapoRow:
    """One validated row. ``prompt`` keeps the chat messages in order; ``ground_truth`` is a stripped string."""

    data_source: str
    prompt: tuple[ChatMessage, ...]
    ability: str
    ground_truth: str
    reward_style: str
    index: str | int
    extra_info: dict | None = field(default=None, compare=False)  # as in the file (reward functions read it)

    @property
    def prompt_key(self) -> tuple[tuple[str, str], ...]:
        """The prompt text used for deduplication: the ordered (role, content) pairs."""
        return tuple((m.role, m.content) for m in self.prompt)

    def messages(self) -> list[dict[str, str]]:
        """The prompt as the list of ``{"role", "content"}`` dicts that ``apply_chat_template`` expects."""
        return [{"role": m.role, "content": m.content} for m in self.prompt]

    def to_schema_dict(self) -> dict[str, Any]:
        """Back to the published row layout (used to write jsonl/parquet files)."""
        return {
            "data_source": self.data_source,
            "prompt": self.messages(),
            "ability": self.ability,
            "reward_model": {"ground_truth": self.ground_truth, "style": self.reward_style},
            "extra_info": {**(self.extra_info or {}), "index": self.index},
        }


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _ground_truth(raw: Any, *, integer_answers: bool, fail: FailFn) -> str:
    if isinstance(raw, bool) or raw is None or not isinstance(raw, (str, int)):
        fail("reward_model.ground_truth", f"must be a string, got {_type_name(raw)}")
    text = str(raw).strip()
    if not text:
        fail("reward_model.ground_truth", "is empty")
    if integer_answers and INTEGER_PATTERN.fullmatch(text) is None:
        fail("reward_model.ground_truth", f"must be an integer (integer_answers=True), got {text!r}")
    return text


def _messages(raw: Any, fail: FailFn) -> tuple[ChatMessage, ...]:
    if not isinstance(raw, (list, tuple)):
        fail("prompt", f"must be a list of chat messages, got {_type_name(raw)}")
    if len(raw) == 0:
        fail("prompt", "has no messages")
    messages = []
    for position, message in enumerate(raw):
        if not isinstance(message, Mapping):
            fail(f"prompt[{position}]", f"must be a {{role, content}} mapping, got {_type_name(message)}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            fail(f"prompt[{position}].role", f"must be one of {CHAT_ROLES}, got {role!r}")
        if not isinstance(content, str):
            fail(f"prompt[{position}].content", f"must be a string, got {_type_name(content)}")
        messages.append(ChatMessage(role=role, content=content))
    if not any(m.role == "user" for m in messages):
        fail("prompt", "has no user message")
    return tuple(messages)


def validate_row(raw: Any, *, source: str, row: int, integer_answers: bool) -> DapoRow:
    """Check one raw row against the schema and return it typed; raise :class:`RowValidationError` otherwise."""
    extra_info = raw.get("extra_info") if isinstance(raw, Mapping) else None
    index = extra_info.get("index") if isinstance(extra_info, Mapping) else None

    def fail(field: str, problem: str) -> NoReturn:
        raise RowValidationError(source, row, field, problem, index=index)

    if not isinstance(raw, Mapping):
        fail("<row>", f"must be a JSON object, got {_type_name(raw)}")
    data_source = raw.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        fail("data_source", f"must be a non-empty string, got {data_source!r}")
    messages = _messages(raw.get("prompt"), fail)
    ability = raw.get("ability")
    if ability is None:
        ability = ""
    elif not isinstance(ability, str):
        fail("ability", f"must be a string, got {_type_name(ability)}")
    reward_model = raw.get("reward_model")
    if not isinstance(reward_model, Mapping):
        fail("reward_model", f"must be a mapping with 'ground_truth', got {_type_name(reward_model)}")
    ground_truth = _ground_truth(reward_model.get("ground_truth"), integer_answers=integer_answers, fail=fail)
    style = reward_model.get("style")
    if style is None:
        style = ""
    elif not isinstance(style, str):
        fail("reward_model.style", f"must be a string, got {_type_name(style)}")
    if extra_info is not None and not isinstance(extra_info, Mapping):
        fail("extra_info", f"must be a mapping, got {_type_name(extra_info)}")
    if index is None:
        index = row
    elif isinstance(index, bool) or not isinstance(index, (str, int)):
        fail("extra_info.index", f"must be a string or an integer, got {_type_name(index)}")
    return DapoRow(
        data_source=data_source,
        prompt=messages,
        ability=ability,
        ground_truth=ground_truth,
        reward_style=style,
        index=index,
        extra_info={**(extra_info or {}), "index": index},
    )
