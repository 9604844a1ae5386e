"""Multi-turn rollouts with tool calls (``rollout.tools.enabled``), on any :class:`RolloutEngine`.

Per response (a *trajectory*): generate until the model closes a tool call (``rollout.tools.call_end``, a stop of
the engine), run the call in the :class:`~dapo_megatron.tools.ToolPool`, append its answer as tokens
(``output_format``, the answer cut at ``max_tool_output_tokens`` tokens) and generate again from the whole context,
until the model ends (EOS), ``max_turns`` generation turns were made (the call that ends the last turn is not run,
the response ends there with reason "stop") or the response reaches ``rollout.max_response_length`` tokens, tool
output included (reason "length"; an answer that does not fit is cut there).

Token in, token out: the ids the engine sampled are kept exactly, with their log-probs and versions; they are
decoded only to find the call, never re-encoded. A tool's answer is encoded on its own and appended. The response
carries ``Sample.loss_mask`` (1: sampled, 0: tool output); a tool token's log-prob is 0.0 and its version that of
the turn before it — values nothing reads, since everything that reads them as sampled reads the mask first.

Concurrency: every turn is a streamed request (:meth:`RolloutEngine.submit`, one per trajectory after the first
turn, which sends each prompt once with its ``n`` samples); a finished turn's call goes to the pool's threads and the
trajectory's next turn is submitted when it returns, so tool calls run while other trajectories generate.

Where the call ends. A tool call is ``call_open`` (with the tool's name) ... ``call_end``. The engine stops at
``call_end`` (the embedded engine on its token ids, SGLang on its text); a turn whose decoded text holds
``call_end`` although the engine did not stop there (a tokenization of it other than the one matched) is cut after
the first token that completes it, so every engine ends a turn at the same place. A closed block that opens no
known tool (```` ```text ````) is not a call: generation goes on in a new turn.

Seeds: with ``params.seed`` set, each turn's request gets a seed derived from (seed, prompt, sample, turn), so a
call with the same prompts, weights and seed replays the same trajectories whatever order the turns finish in.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import Sequence

from dapo_megatron.rollout.engine import GenerationRequest, RolloutEngine, Sample, SamplingParams, ToolUse
from dapo_megatron.config.tools import ToolsConfig
from dapo_megatron.tools.pool import ToolPool
from dapo_megatron.tools.result import ToolResult

_POLL_S = 0.02
_call_numbers = itertools.count()


class ToolCallFormat:
    """``rollout.tools``' call syntax applied to one tokenizer and the pool's tool names."""

    def __init__(self, tools: ToolsConfig, tokenizer, tool_names: Sequence[str]):
        self.tokenizer = tokenizer
        self.end = tools.call_end
        self.end_ids = tuple(tokenizer.encode(tools.call_end, add_special_tokens=False))
        self._call_open = tools.call_open
        before, after = tools.call_open.split("{tool}")
        names = "|".join(re.escape(name) for name in sorted(tool_names, key=len, reverse=True))
        self._opener = re.compile(f"{re.escape(before)}({names}){re.escape(after)}")
        self.max_output_tokens = tools.max_tool_output_tokens
        self._output_before, self._output_after = tools.output_format.split("{output}")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def call_end_length(self, before: Sequence[int], turn: Sequence[int]) -> int | None:
        """The fewest tokens of ``turn`` whose text, after that of ``before``, completes ``call_end``; None when
        the turn holds no call end."""
        start = max(0, len(self.decode(before)) - len(self.end) + 1)

        def holds(count: int) -> bool:
            return self.decode([*before, *turn[:count]]).find(self.end, start) != -1

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

    def find_call(self, segment: Sequence[int]) -> tuple[str, str] | None:
        """(tool name, text) of the call that ``segment`` (the model's tokens since the last tool output, or the
        prompt and them) ends with; None when the block it closes opens no known tool."""
        text = self.decode(segment)
        end = text.rfind(self.end)
        openers = list(self._opener.finditer(text, 0, end)) if end != -1 else []
        if not openers:
            return None
        opener = openers[-1]
        return opener.group(1), text[opener.end():end]

    def call_text(self, tool: str, text: str) -> str:
        """A call of ``tool`` with ``text`` as the model writes it: what :meth:`find_call` reads back."""
        return self._call_open.format(tool=tool) + text + self.end

    def output_ids(self, result: ToolResult) -> list[int]:
        encode = self.tokenizer.encode
        answer = encode(result.text.rstrip("\n"), add_special_tokens=False)[:self.max_output_tokens]
        return (encode(self._output_before, add_special_tokens=False) + answer
                + encode(self._output_after, add_special_tokens=False))


@dataclass
class _Trajectory:
    prompt_index: int
    sample_index: int
    prompt: list[int]
    metadata: dict
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    use: ToolUse = field(default_factory=ToolUse)
    segment_start: int = 0  # where the model's tokens since the last tool output begin (0: with the prompt)
    finish_reason: str | None = None

    def segment(self, end: int | None = None) -> list[int]:
        tokens = self.token_ids[self.segment_start:end]
        return self.prompt + tokens if self.segment_start == 0 else tokens

    def add(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], sampled: bool) -> None:
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
        self.mask.extend([int(sampled)] * len(ids))

    def sample(self, fallback_version: int) -> Sample:
        versions = self.versions
        return Sample(prompt_index=self.prompt_index, token_ids=self.token_ids, logprobs=self.logprobs,
                      finish_reason=self.finish_reason, weight_version=min(versions, default=fallback_version),
                      token_versions=list(versions), loss_mask=self.mask, tool_use=self.use)


class MultiTurnRollout:
    """Generates multi-turn responses on ``engine`` with ``pool``'s tools (see the module docstring).
    ``max_response_length`` bounds each response, tool output included."""

    def __init__(self, engine: RolloutEngine, tokenizer, tools: ToolsConfig, pool: ToolPool, *,
                 max_response_length: int):
        self.engine = engine
        self.pool = pool
        self.tools = tools
        self.format = ToolCallFormat(tools, tokenizer, pool.names)
        self.budget = max_response_length

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 metadata: Sequence[dict] | None = None) -> list[list[Sample]]:
        """For each prompt in order, its ``params.n`` responses; ``metadata[i]`` reaches prompt i's tool calls."""
        metadata = list(metadata) if metadata is not None else [{} for _ in prompts]
        call = next(_call_numbers)
        turn_params = replace(params, max_new_tokens=min(params.max_new_tokens, self.budget),
                              stop_sequences=params.stop_sequences + (self.format.end_ids,),
                              stop_strings=params.stop_strings + (self.format.end,))
        trajectories = [[_Trajectory(i, j, list(prompt), {**metadata[i], "sample_index": j})
                         for j in range(params.n)] for i, prompt in enumerate(prompts)]
        in_flight: dict[str, list[_Trajectory]] = {}
        tool_calls: dict[Future, _Trajectory] = {}
        first = [GenerationRequest(f"mt{call}-{i}", tuple(prompt), replace(turn_params, seed=_seed(params.seed, i)))
                 for i, prompt in enumerate(prompts)]
        in_flight.update({request.request_id: trajectories[i] for i, request in enumerate(first)})
        try:
            self.engine.submit(first)
            while in_flight or tool_calls:
                for finished in self.engine.poll(timeout_s=_POLL_S if in_flight else 0.0):
                    if finished.request_id not in in_flight:  # aborted by an earlier call that failed
                        continue
                    for trajectory, sample in zip(in_flight.pop(finished.request_id), finished.samples, strict=True):
                        self._after_turn(trajectory, sample, tool_calls, in_flight, turn_params, call)
                if tool_calls:
                    done, _ = wait(list(tool_calls), timeout=0.0 if in_flight else _POLL_S,
                                   return_when=FIRST_COMPLETED)
                    for future in done:
                        self._after_tool(tool_calls.pop(future), future.result(), in_flight, turn_params, call)
        except BaseException:
            self.engine.abort(list(in_flight))
            raise
        return [[t.sample(self.engine.weight_version) for t in group] for group in trajectories]

    def _after_turn(self, trajectory: _Trajectory, turn: Sample, tool_calls: dict, in_flight: dict,
                    params: SamplingParams, call: int) -> None:
        use = trajectory.use
        use.turns += 1
        ids = list(turn.token_ids)
        versions = list(turn.token_versions) or [turn.weight_version] * len(ids)
        end = self.format.call_end_length(trajectory.segment(), ids) if turn.finish_reason != "abort" else None
        if end is not None:  # a call's end; anything the engine sampled after it is not part of the response
            ids, versions = ids[:end], versions[:end]
        trajectory.add(ids, list(turn.logprobs)[:len(ids)], versions, sampled=True)
        remaining = self.budget - len(trajectory.token_ids)
        if end is None:
            trajectory.finish_reason = turn.finish_reason
            return
        found = self.format.find_call(trajectory.segment())
        if remaining <= 0 or use.turns >= self.tools.max_turns:
            trajectory.finish_reason = "length" if remaining <= 0 else "stop"
        elif found is None:  # a closed block that calls no tool: the model goes on
            self._submit_turn(trajectory, in_flight, params, call)
        else:
            name, text = found
            use.calls += 1
            future = self.pool.submit(name, text, {**trajectory.metadata, "turn": use.turns})
            tool_calls[future] = trajectory

    def _after_tool(self, trajectory: _Trajectory, result: ToolResult, in_flight: dict, params: SamplingParams,
                    call: int) -> None:
        use = trajectory.use
        use.failed += int(not result.ok)
        use.timeouts += int(result.kind == "timeout")
        remaining = self.budget - len(trajectory.token_ids)
        ids = self.format.output_ids(result)[:remaining]
        version = trajectory.versions[-1] if trajectory.versions else self.engine.weight_version
        trajectory.add(ids, [0.0] * len(ids), [version] * len(ids), sampled=False)
        use.output_tokens += len(ids)
        trajectory.segment_start = len(trajectory.token_ids)
        if len(ids) >= remaining:
            trajectory.finish_reason = "length"
        else:
            self._submit_turn(trajectory, in_flight, params, call)

    def _submit_turn(self, trajectory: _Trajectory, in_flight: dict, params: SamplingParams, call: int) -> None:
        i, j, turn = trajectory.prompt_index, trajectory.sample_index, trajectory.use.turns
        request = GenerationRequest(
            f"mt{call}-{i}.{j}.{turn}", tuple(trajectory.prompt + trajectory.token_ids),
            replace(params, n=1, max_new_tokens=self.budget - len(trajectory.token_ids),
                    seed=_seed(params.seed, i, j, turn)))
        in_flight[request.request_id] = [trajectory]
        self.engine.submit([request])


def _seed(seed: int | None, *position: int) -> int | None:
    if seed is None:
        return None
    digest = hashlib.blake2b("/".join(map(str, (seed, *position))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2

