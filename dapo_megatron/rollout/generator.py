"""The one interface the collectors and validation get rollouts from: a batch of prompts in, for each its ``n``
trajectories out, ready to be scored (:class:`RolloutGenerator`).

Two implementations, chosen once when the run is built (:func:`dapo_megatron.rollout.factory.build_rollout_generator`):

* :class:`SingleTurnGenerator` — one generation per response, straight from the :class:`RolloutEngine`;
* :class:`~dapo_megatron.rollout.multi_turn.MultiTurnGenerator` — responses that call tools, turn by turn
  (``rollout.tools.enabled``).

Both offer what the engine offers, at the level of whole trajectories: :meth:`~RolloutGenerator.generate` (blocking:
the sync collector, validation, the warm-start) and the streamed :meth:`~RolloutGenerator.submit` /
:meth:`~RolloutGenerator.poll` / :meth:`~RolloutGenerator.abort` (the async collector), with one request per prompt
(:class:`PromptRequest`) coming back as a :class:`FinishedRequest` when all ``n`` trajectories are done. So no caller
branches on tools, and a new kind of rollout (an agent loop) is one more implementation. (verl's agent loops and
slime's pluggable rollout function are the same idea: one "prompt in, trajectory out" call the trainer does not
look behind.)

A generator's streamed requests and its blocking calls may run at once from two threads (async mode validates while
the driver streams): each gets its own results.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterable, Sequence

from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.rollout.engine import FinishedRequest, GenerationRequest, RolloutEngine, Sample, SamplingParams


@dataclass(frozen=True)
class PromptRequest:
    """One streamed request: ``params.n`` trajectories of ``record``'s prompt. ``request_id`` must be unique among
    the requests in flight."""

    request_id: str
    record: PromptRecord
    params: SamplingParams


class RolloutGenerator(abc.ABC):
    """Trajectories for prompts on ``engine`` (see the module docstring)."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    @property
    def tool_names(self) -> list[str]:
        """The tools trajectories may call (their counts are logged per tool); none by default."""
        return []

    @abc.abstractmethod
    def generate(self, records: Sequence[PromptRecord], params: SamplingParams) -> list[list[Sample]]:
        """For each record in order, its ``params.n`` trajectories."""

    @abc.abstractmethod
    def submit(self, requests: Sequence[PromptRequest]) -> None:
        """Start ``requests`` in the background and return at once."""

    @abc.abstractmethod
    def poll(self, timeout_s: float = 0.0) -> list[FinishedRequest]:
        """The streamed requests whose trajectories are all done (or aborted) since the last call, waiting up to
        ``timeout_s`` for one; raises what the engine raises."""

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop these streamed requests; they come back from :meth:`poll` with ``finish_reason == "abort"`` in the
        trajectories that had not ended. Unknown or finished ids are ignored."""

    @property
    @abc.abstractmethod
    def num_in_flight(self) -> int:
        """Streamed requests submitted and not yet returned by :meth:`poll`."""

    def close(self) -> None:
        """Release what the generator holds (not the engine, which the run closes itself)."""


class SingleTurnGenerator(RolloutGenerator):
    """One generation per response: the engine's own calls."""

    def generate(self, records: Sequence[PromptRecord], params: SamplingParams) -> list[list[Sample]]:
        return self.engine.generate([record.prompt_ids for record in records], params)

    def submit(self, requests: Sequence[PromptRequest]) -> None:
        self.engine.submit([GenerationRequest(r.request_id, tuple(r.record.prompt_ids), r.params) for r in requests])

    def poll(self, timeout_s: float = 0.0) -> list[FinishedRequest]:
        return self.engine.poll(timeout_s=timeout_s)

    def abort(self, request_ids: Iterable[str]) -> None:
        self.engine.abort(request_ids)

    @property
    def num_in_flight(self) -> int:
        return self.engine.num_in_flight
