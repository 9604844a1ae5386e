"""How a model writes a tool call, and how the tool's answer is put back into its context: ``rollout.tools.format``.

=========== ========================================================== ======================================
format      a call, as the model writes it                             where a turn stops, and the answer
=========== ========================================================== ======================================
``fence``   ```` ```python\\nprint(6*7)\\n```\\n ```` (``call_open``      ``call_end``; the answer as
            with the tool's name, its one text argument, ``call_end``)  ``output_format`` (```` ```output ````)
``hermes``  ``<tool_call>\\n{"name": "python", "arguments":              ``</tool_call>``; the answer as
            {"code": "print(6*7)"}}\\n</tool_call>`` (Qwen2.5 / Qwen3,   ``hermes_output_format`` (Qwen's
            Hermes-style instruct models)                              ``<tool_response>`` user turn)
=========== ========================================================== ======================================

A format works on token ids the engine sampled and never re-encodes them: it decodes to find where a call ends
(:meth:`CallFormat.call_end_length`, a window around the end of the context, not the whole of it) and what it asks
(:meth:`CallFormat.find_call`), and encodes only the tool's answer (:meth:`CallFormat.output_ids`). What the model
wrote is hostile input: a call that cannot be read (bad JSON, arguments that are not an object) is a
:class:`ToolCall` with a ``problem``, which the rollout answers as a refused call the model reads.
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from dapo_megatron.config.tools import ToolsConfig
from dapo_megatron.tools.result import ToolResult


@dataclass(frozen=True)
class ToolCall:
    """What a model's call asks: tool ``name`` with ``arguments`` (the JSON object, or the text of the tool's one
    argument). ``problem``: why the call cannot run (then it is answered with that text, as a refused call)."""

    name: str
    arguments: str | Mapping[str, object] = field(default_factory=dict)
    problem: str | None = None


class CallFormat(abc.ABC):
    """One call syntax applied to one tokenizer and the pool's tools."""

    end: str  # where a turn stops (the engines' stop string) when the model closes a call

    def __init__(self, tools: ToolsConfig, tokenizer, tool_names: Sequence[str], output_format: str):
        self.tokenizer = tokenizer
        self.tool_names = list(tool_names)
        self.end_ids = tuple(tokenizer.encode(self.end, add_special_tokens=False))
        self.max_output_tokens = tools.max_tool_output_tokens
        self._output_before, self._output_after = output_format.split("{output}")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def call_end_length(self, before: Sequence[int], turn: Sequence[int]) -> int | None:
        """The fewest tokens of ``turn`` whose text, after that of ``before``, completes :attr:`end`; None when the
        turn holds no call end. Decodes a window of ``before`` (enough of its last tokens to hold ``len(end) - 1``
        characters besides the first of them, which may decode differently alone) and the turn, ~log2(len(turn))
        times: the cost does not grow with the prompt."""
        window = self._window(before)
        start = max(0, len(self.decode(window)) - len(self.end) + 1)  # a match must end inside the turn

        def holds(count: int) -> bool:
            return self.decode([*window, *turn[:count]]).find(self.end, start) != -1

        if not turn or not holds(len(turn)):
            return None
        low, high = 1, len(turn)  # holds(high); the first count that holds, by bisection (holding is monotone)
        while low < high:
            middle = (low + high) // 2
            if holds(middle):
                high = middle
            else:
                low = middle + 1
        return low

    def _window(self, before: Sequence[int]) -> list[int]:
        size = min(len(before), len(self.end_ids) + 1)
        while size < len(before) and len(self.decode(before[len(before) - size + 1:])) < len(self.end) - 1:
            size = min(len(before), 2 * size)
        return list(before[len(before) - size:])

    @abc.abstractmethod
    def find_call(self, segment: Sequence[int]) -> ToolCall | None:
        """The call that ``segment`` (the model's tokens since the last tool output, or the prompt and them) ends
        with; None when what it closes is no call (the model goes on)."""

    @abc.abstractmethod
    def call_text(self, tool: str, arguments: Mapping[str, object]) -> str:
        """A call of ``tool`` as the model writes it (what :meth:`find_call` reads back): the warm-start's traces."""

    def output_ids(self, result: ToolResult) -> list[int]:
        """The tool's answer as the context continues: its text cut at ``max_tool_output_tokens`` tokens, wrapped."""
        encode = self.tokenizer.encode
        answer = encode(result.text.rstrip("\n"), add_special_tokens=False)[:self.max_output_tokens]
        return (encode(self._output_before, add_special_tokens=False) + answer
                + encode(self._output_after, add_special_tokens=False))


class FencedCalls(CallFormat):
    """```` ```python\\n<text>\\n```\\n ````: a fenced block whose info string names a tool; the block's text is the
    tool's one argument. A closed block that names no tool (```` ```text ````) is no call."""

    def __init__(self, tools: ToolsConfig, tokenizer, tool_names: Sequence[str]):
        self.end = tools.call_end
        super().__init__(tools, tokenizer, tool_names, tools.output_format)
        self._call_open = tools.call_open
        before, after = tools.call_open.split("{tool}")
        names = "|".join(re.escape(name) for name in sorted(tool_names, key=len, reverse=True))
        self._opener = re.compile(f"{re.escape(before)}({names}){re.escape(after)}")

    def find_call(self, segment: Sequence[int]) -> ToolCall | None:
        text = self.decode(segment)
        end = text.rfind(self.end)
        openers = list(self._opener.finditer(text, 0, end)) if end != -1 and self.tool_names else []
        if not openers:
            return None
        opener = openers[-1]
        return ToolCall(opener.group(1), text[opener.end():end])

    def call_text(self, tool: str, arguments: Mapping[str, object]) -> str:
        (text,) = arguments.values()
        return self._call_open.format(tool=tool) + str(text) + self.end


class HermesCalls(CallFormat):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, the JSON tool calls of Qwen2.5 / Qwen3 and
    the Hermes-style instruct models (their chat templates write a call so, and their tool parsers read it so)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: ToolsConfig, tokenizer, tool_names: Sequence[str]):
        self.end = self.CLOSE
        super().__init__(tools, tokenizer, tool_names, tools.hermes_output_format)

    def find_call(self, segment: Sequence[int]) -> ToolCall | None:
        text = self.decode(segment)
        end = text.rfind(self.CLOSE)
        start = text.rfind(self.OPEN, 0, end) if end != -1 else -1
        if start == -1:
            return None  # a closing tag with no call before it: no call
        body = text[start + len(self.OPEN):end].strip()
        try:
            call = json.loads(body)
        except ValueError as error:
            return ToolCall("", problem=f"[the tool call is not valid JSON ({error}): {body[:200]!r}]")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolCall("", problem=f'[a tool call is {{"name": <tool>, "arguments": {{...}}}}, got '
                                        f'{body[:200]!r}]')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments object as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            return ToolCall(call["name"], problem=f"[the arguments of {call['name']!r} must be a JSON object, got "
                                                  f"{json.dumps(arguments)[:200]}]")
        return ToolCall(call["name"], arguments)

    def call_text(self, tool: str, arguments: Mapping[str, object]) -> str:
        return f"{self.OPEN}\n{json.dumps({'name': tool, 'arguments': dict(arguments)})}\n{self.CLOSE}"


CALL_FORMATS: dict[str, type[CallFormat]] = {"fence": FencedCalls, "hermes": HermesCalls}


def call_format(tools: ToolsConfig, tokenizer, tool_names: Sequence[str]) -> CallFormat:
    """``rollout.tools.format``'s syntax on ``tokenizer`` for the pool's tools ``tool_names``."""
    return CALL_FORMATS[tools.format](tools, tokenizer, tool_names)
