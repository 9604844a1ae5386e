"""``warm_start.traces``: your own multi-turn traces as the warm-start's reference responses (ReTool's recipe starts
RL from a model fine-tuned on such traces).

A JSONL file, one trace a line: a DAPO-Math row (``data_source`` optional) plus the ``response`` it should learn, the
model's turns and the tools' answers in order, ending with the model's::

    {"prompt": [{"role": "user", "content": "What is 438*583?"}],
     "reward_model": {"ground_truth": "255354"},
     "response": [{"role": "assistant", "content": "```python\\nprint(438*583)\\n```\\n"},
                  {"role": "tool", "content": "255354"},
                  {"role": "assistant", "content": "Answer: 255354"}]}

The prompt is rendered as training renders prompts (the chat template, ``rollout.tools.system_prompt`` unless the row
has a system message). Each assistant turn is trained as written; a tool's answer goes in as the rollout appends it
(the call format's output wrapper, cut at ``max_tool_output_tokens``) and is not trained; EOS follows the last turn.
An assistant turn followed by a tool's answer must end with a call the run's call format reads — what a rollout
would have run there. A line that breaks any of this is refused with the file, the line and what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dapo_megatron.data.prompts import PromptRecord, build_prompt_records
from dapo_megatron.data.schema import RowValidationError, validate_row
from dapo_megatron.tools.call_formats import CallFormat
from dapo_megatron.tools.result import ToolResult
from dapo_megatron.user_errors import DataError

# A reference response as token ids, and which of them the loss trains (1) or leaves out (0: prompt, tool output).
Example = tuple[list[int], list[int]]
ROLES = ("assistant", "tool")


@dataclass(frozen=True)
class Trace:
    record: PromptRecord
    response: tuple[tuple[str, str], ...]  # (role, content), assistant first and last


def read_traces(path: str | Path, tokenizer, *, max_prompt_length: int, system_prompt: str | None,
                calls: CallFormat | None) -> list[Trace]:
    """The traces of ``path``, checked (``calls``: the run's call format, None when tools are off: then a trace
    may not hold a tool's answer)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise DataError(f"warm_start.traces: cannot read {path}: {error}") from None
    traces = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"warm_start.traces: {path} line {number}"
        try:
            raw = json.loads(line)
        except ValueError as error:
            raise DataError(f"{where}: not JSON ({error})") from None
        if not isinstance(raw, dict):
            raise DataError(f"{where}: must be a JSON object, got {type(raw).__name__}")
        try:
            row = validate_row({"data_source": "warm_start_traces", **raw}, source=str(path), row=number - 1,
                               integer_answers=False)
        except RowValidationError as error:
            raise DataError(f"{where}: {error}") from None
        built = build_prompt_records([row], tokenizer, max_prompt_length=max_prompt_length,
                                     system_prompt=system_prompt).records
        if not built:
            raise DataError(f"{where}: the prompt is longer than data.max_prompt_length={max_prompt_length} tokens")
        traces.append(Trace(built[0], _response(raw.get("response"), where, calls)))
    if not traces:
        raise DataError(f"warm_start.traces: {path} holds no trace")
    return traces


def _response(raw: object, where: str, calls: CallFormat | None) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: 'response' must be a non-empty list of {{role, content}} turns")
    turns = []
    for position, turn in enumerate(raw):
        role = turn.get("role") if isinstance(turn, dict) else None
        content = turn.get("content") if isinstance(turn, dict) else None
        if role not in ROLES or not isinstance(content, str):
            raise DataError(f"{where}: response[{position}] must be {{\"role\": \"assistant\" | \"tool\", "
                            f"\"content\": <text>}}, got {json.dumps(turn)[:200]}")
        turns.append((role, content))
    if turns[0][0] != "assistant" or turns[-1][0] != "assistant":
        raise DataError(f"{where}: 'response' must begin and end with an assistant turn")
    for position, ((role, content), (next_role, _)) in enumerate(zip(turns, turns[1:])):
        if role == next_role == "tool":
            raise DataError(f"{where}: response[{position + 1}]: two tool answers in a row (one call, one answer)")
        if next_role != "tool":
            continue
        if calls is None:
            raise DataError(f"{where}: response[{position + 1}] is a tool's answer, but rollout.tools.enabled is off")
        if not content.endswith(calls.end) or calls.find_call(calls.tokenizer.encode(
                content, add_special_tokens=False)) is None:
            raise DataError(f"{where}: response[{position}] is followed by a tool's answer but does not end with a "
                            f"call the rollout.tools.format={calls.__class__.__name__} reads (ending {calls.end!r})")
    return tuple(turns)


def trace_example(trace: Trace, tokenizer, calls: CallFormat | None) -> Example:
    """prompt + the trace's turns + EOS as token ids, with which of them are trained."""
    ids, trained = list(trace.record.prompt_ids), [0] * len(trace.record.prompt_ids)
    for role, content in trace.response:
        if role == "assistant":
            piece = tokenizer.encode(content, add_special_tokens=False)
        else:
            piece = calls.output_ids(ToolResult("trace", content, ok=True, kind=None, wall_s=0.0))
        ids += piece
        trained += [int(role == "assistant")] * len(piece)
    return ids + [tokenizer.eos_token_id], trained + [1]
