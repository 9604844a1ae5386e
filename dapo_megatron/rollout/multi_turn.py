"""Multi-turn rollouts with tool calls (``rollout.tools.enabled``): the :class:`MultiTurnGenerator` implementation of
:class:`~dapo_megatron.rollout.generator.RolloutGenerator`, on any :class:`RolloutEngine`.

Per response (a *trajectory*, :mod:`.trajectory`): generate until the model closes a tool call (the call format's
:attr:`~dapo_megatron.tools.CallFormat.end`, a stop of the engine), run the call in the run's
:class:`~dapo_megatron.tools.ToolPool`, append its answer as tokens (the format's output wrapper, the answer cut at
``max_tool_output_tokens`` tokens) and generate again from the whole context, until the model ends (EOS),
``max_turns`` generation turns were made (the call that ends the last turn is not run, the response ends there with
reason "stop") or the response reaches ``params.max_new_tokens`` tokens (``rollout.max_response_length`` in
training), tool output included (reason "length"; an answer that does not fit is cut there).

Token in, token out: the ids the engine sampled are kept exactly, with their log-probs, versions and routing; they are
decoded only to find the call, never re-encoded. A tool's answer is encoded on its own and appended.

Concurrency: every turn is a streamed request (:meth:`RolloutEngine.submit`; the first turn sends each prompt once
with its ``n`` samples, later turns one trajectory each); a finished turn's call goes to the pool's threads and the
trajectory's next turn is submitted when it returns, so tool calls run while other trajectories generate. The same
state serves streamed requests (the async driver's thread) and blocking :meth:`~MultiTurnGenerator.generate` calls
(validation on the trainer's thread) at once: whichever thread polls the engine advances every trajectory, and each
caller receives its own.

Where the call ends. The engine stops at the format's end (the embedded engine on its token ids, SGLang on its text);
a turn whose decoded text holds the end although the engine did not stop there (a tokenization of it other than the
one matched) is cut after the first token that completes it, so every engine ends a turn at the same place. A block
the format reads as no call (a fence of no known tool) is not a call: generation goes on in a new turn; a call it
cannot read (bad JSON) is answered as a refused call.

Weight updates while a trajectory is out (async mode): a turn in flight continues on the new weights (the engine's
partial rollout) and the next turn is sampled by the weights of then; every token keeps its version, so staleness and
the rollout correction read a multi-turn response as a single-turn one. Aborting a request ends its trajectories at
once, a tool call in flight included (its answer is dropped).

Seeds: with ``params.seed`` set, each turn's request gets a seed derived from (seed, prompt, sample, turn), so a
call with the same prompts, weights and seed replays the same trajectories whatever order the turns finish in.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from dapo_megatron.config.tools import ToolsConfig
from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.rollout.engine import FinishedRequest, GenerationRequest, RolloutEngine, Sample, SamplingParams
from dapo_megatron.rollout.generator import PromptRequest, RolloutGenerator
from dapo_megatron.rollout.trajectory import Trajectory
from dapo_megatron.tools.call_formats import CallFormat, call_format
from dapo_megatron.tools.pool import ToolPool
from dapo_megatron.tools.result import ToolResult

_POLL_S = 0.02
_call_numbers = itertools.count()


def tool_metadata(record: PromptRecord) -> dict:
    """What a tool call learns about its prompt (never the ground truth: the model must not reach it)."""
    return {"data_source": record.data_source, "index": record.index, "extra_info": dict(record.extra_info or {})}


@dataclass
class _Group:
    """One request: the ``n`` trajectories of one prompt, and where it goes when all are done."""

    request_id: str
    trajectories: list[Trajectory]
    params: SamplingParams  # each turn's (the call's end among its stops)
    budget: int  # tokens of each response, tool output included
    seed: int | None
    prompt_index: int
    delivered_to: list[FinishedRequest]
    aborted: bool = False

    @property
    def done(self) -> bool:
        return all(t.finish_reason is not None for t in self.trajectories)


class MultiTurnGenerator(RolloutGenerator):
    """Multi-turn trajectories on ``engine`` with ``pool``'s tools, in ``tools.format``'s call syntax (see the module
    docstring). The generator closes ``pool`` when it is closed."""

    def __init__(self, engine: RolloutEngine, tokenizer, tools: ToolsConfig, pool: ToolPool):
        super().__init__(engine)
        self.pool = pool
        self.tools = tools
        self.format: CallFormat = call_format(tools, tokenizer, pool.names)
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}
        self._turns: dict[str, list[Trajectory]] = {}  # engine request id → the trajectories it generates
        self._tool_calls: dict[Future, Trajectory] = {}
        self._streamed: list[FinishedRequest] = []  # done groups of submit(), until poll() takes them

    @property
    def tool_names(self) -> list[str]:
        return self.pool.names

    # ---- the interface ---------------------------------------------------------------------------------------------
    def generate(self, records: Sequence[PromptRecord], params: SamplingParams) -> list[list[Sample]]:
        call = next(_call_numbers)
        delivered: list[FinishedRequest] = []
        requests = [PromptRequest(f"mt{call}-{i}", record, params) for i, record in enumerate(records)]
        with self._lock:
            for index, request in enumerate(requests):
                self._start(request, index, delivered)
        try:
            while len(delivered) < len(requests):
                self._advance()
        except BaseException:
            self.abort([request.request_id for request in requests])
            raise
        by_id = {finished.request_id: finished.samples for finished in delivered}
        return [by_id[request.request_id] for request in requests]

    def submit(self, requests: Sequence[PromptRequest]) -> None:
        with self._lock:
            for request in requests:
                if request.request_id in self._groups:
                    raise ValueError(f"MultiTurnGenerator.submit: request id {request.request_id!r} is in flight")
                self._start(request, 0, self._streamed)

    def poll(self, timeout_s: float = 0.0) -> list[FinishedRequest]:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._streamed:  # emptied in place: the groups in flight deliver to this list
                    finished = list(self._streamed)
                    self._streamed.clear()
                    return finished
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            self._advance(min(_POLL_S, remaining))

    def abort(self, request_ids: Iterable[str]) -> None:
        turns = []
        with self._lock:
            for request_id in request_ids:
                group = self._groups.get(request_id)
                if group is None:
                    continue
                group.aborted = True
                turns += [turn for turn, trajectories in self._turns.items()
                          if trajectories[0].request_id == request_id]
                for future, trajectory in list(self._tool_calls.items()):  # their answers are dropped
                    if trajectory.request_id == request_id:
                        del self._tool_calls[future]
                        self._finish(trajectory, "abort")
        if turns:
            self.engine.abort(turns)  # they come back from the engine with reason "abort"

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return sum(group.delivered_to is self._streamed for group in self._groups.values()) + len(self._streamed)

    def close(self) -> None:
        """Abort what is in flight and close the tool pool (it waits for the calls running)."""
        with self._lock:
            in_flight = list(self._groups)
        self.abort(in_flight)
        self.pool.close()

    # ---- the trajectories' way -------------------------------------------------------------------------------------
    def _start(self, request: PromptRequest, prompt_index: int, delivered_to: list[FinishedRequest]) -> None:
        params = request.params
        calls = self.format
        turn_params = replace(params, stop_sequences=params.stop_sequences + (calls.end_ids,),
                              stop_strings=params.stop_strings + (calls.end,))
        metadata = tool_metadata(request.record)
        prompt = list(request.record.prompt_ids)
        trajectories = [Trajectory(request.request_id, prompt_index, j, prompt, {**metadata, "sample_index": j})
                        for j in range(params.n)]
        self._groups[request.request_id] = _Group(request.request_id, trajectories, turn_params,
                                                  params.max_new_tokens, params.seed, prompt_index, delivered_to)
        self._turns[request.request_id] = trajectories
        self.engine.submit([GenerationRequest(request.request_id, tuple(prompt),
                                              replace(turn_params, seed=_seed(params.seed, prompt_index)))])

    def _advance(self, timeout_s: float = _POLL_S) -> None:
        """Take the turns and tool calls that finished (waiting up to ``timeout_s`` for one) and move their
        trajectories on."""
        with self._lock:
            turns_out, tool_calls = bool(self._turns), list(self._tool_calls)
        if tool_calls and not turns_out:  # only tools to wait for
            finished = self.engine.poll(timeout_s=0.0)
            if not finished:
                wait(tool_calls, timeout=timeout_s, return_when=FIRST_COMPLETED)
        else:
            finished = self.engine.poll(timeout_s=timeout_s)
        with self._lock:
            for request in finished:
                trajectories = self._turns.pop(request.request_id, None)
                if trajectories is None:  # not ours, or aborted and already accounted
                    continue
                for trajectory, turn in zip(trajectories, request.samples, strict=True):
                    self._after_turn(trajectory, turn)
            for future in [f for f in self._tool_calls if f.done()]:
                self._after_tool(self._tool_calls.pop(future), future.result())

    def _after_turn(self, trajectory: Trajectory, turn: Sample) -> None:
        use = trajectory.use
        use.turns += 1
        calls = self.format
        end = calls.call_end_length(trajectory.segment(), turn.token_ids) if turn.finish_reason != "abort" else None
        # a call's end: anything the engine sampled after it is not part of the response
        trajectory.add_turn(turn, end if end is not None else len(turn.token_ids))
        group = self._groups[trajectory.request_id]
        remaining = group.budget - len(trajectory.token_ids)
        if end is None:
            self._finish(trajectory, turn.finish_reason)
        elif group.aborted:
            self._finish(trajectory, "abort")
        elif remaining <= 0 or use.turns >= self.tools.max_turns:
            self._finish(trajectory, "length" if remaining <= 0 else "stop")
        elif (found := calls.find_call(trajectory.segment())) is None:  # a closed block that calls no tool
            self._submit_turn(trajectory)
        else:
            use.calls += 1
            metadata = {**trajectory.metadata, "turn": use.turns}
            future = (self.pool.refuse(found.name, found.problem) if found.problem is not None
                      else self.pool.submit(found.name, found.arguments, metadata))
            self._tool_calls[future] = trajectory

    def _after_tool(self, trajectory: Trajectory, result: ToolResult) -> None:
        group = self._groups[trajectory.request_id]
        remaining = group.budget - len(trajectory.token_ids)
        ids = self.format.output_ids(result)[:remaining]
        trajectory.add_tool_output(ids, result, self.engine.weight_version)
        if len(ids) >= remaining:
            self._finish(trajectory, "length")
        elif group.aborted:
            self._finish(trajectory, "abort")
        else:
            self._submit_turn(trajectory)

    def _submit_turn(self, trajectory: Trajectory) -> None:
        group = self._groups[trajectory.request_id]
        j, turn = trajectory.sample_index, trajectory.use.turns
        request = GenerationRequest(
            f"{group.request_id}.{j}.{turn}", tuple(trajectory.prompt + trajectory.token_ids),
            replace(group.params, n=1, max_new_tokens=group.budget - len(trajectory.token_ids),
                    seed=_seed(group.seed, group.prompt_index, j, turn)))
        self._turns[request.request_id] = [trajectory]
        self.engine.submit([request])

    def _finish(self, trajectory: Trajectory, reason: str) -> None:
        trajectory.finish_reason = reason
        group = self._groups[trajectory.request_id]
        if group.done:
            del self._groups[group.request_id]
            group.delivered_to.append(FinishedRequest(
                group.request_id, [t.sample(self.engine.weight_version) for t in group.trajectories]))


def _seed(seed: int | None, *position: int) -> int | None:
    if seed is None:
        return None
    digest = hashlib.blake2b("/".join(map(str, (seed, *position))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2
