"""Where every prompt the async rollout driver drew is, and the books that show none is lost.

A drawn prompt is *queued* (to be generated, again after an abort), *in flight* (a streamed request; *aborting*
once the driver aborted it and until it comes back), a buffered group (the collector's buffer), or has an outcome:
trained, filtered (dynamic sampling), dropped (too stale). :class:`PromptLedger` counts the outcomes, so that every
step drawn = trained + filtered + dropped + held (buffered, queued or in flight).

The checkpoint holds the queued and in-flight prompts as one list (``pending_prompts``: generated first after
``--resume``) and the ledger; :meth:`AsyncPrompts.load_state_dict` also reads a sync-mode checkpoint, which has
neither.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.data.sampler import PromptSampler


@dataclass
class PromptLedger:
    """Cumulative prompt accounting (checkpointed): every prompt drawn ends trained, filtered, dropped or held."""

    drawn: int = 0
    trained: int = 0
    filtered: int = 0  # dynamic sampling: all answers right or all wrong
    dropped: int = 0  # too stale to train, or spanning more versions than allowed
    requeued: int = 0  # aborted and queued again (not an outcome: the prompt is held again)
    regenerated_after_resume: int = 0

    def metrics(self, held: int) -> dict[str, float]:
        return {f"async/ledger/{k}": float(v) for k, v in asdict(self).items()} | {"async/ledger/held": float(held)}


class AsyncPrompts:
    """The queued and in-flight prompts of the async driver, and its ledger (see the module docstring). The collector
    calls it under its lock."""

    def __init__(self) -> None:
        self.ledger = PromptLedger()
        self.queued: deque[PromptRecord] = deque()  # generated before new prompts are drawn
        self._in_flight: dict[str, tuple[PromptRecord, int]] = {}  # request id → (prompt, engine version at submit)
        self._aborting: set[str] = set()  # aborted by the driver, not back yet
        self._next_request = 0
        self._regenerated: int | None = None  # prompts a resumed run generates again, reported once

    # ---- counts ---------------------------------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_live(self) -> int:
        """In flight and not aborted: requests that may still become groups."""
        return len(self._in_flight) - len(self._aborting)

    def in_flight_records(self) -> list[PromptRecord]:
        return [record for record, _ in self._in_flight.values()]

    def request_ids(self) -> list[str]:
        return list(self._in_flight)

    # ---- a prompt's way -------------------------------------------------------------------------------------------
    def take(self, count: int, sampler: PromptSampler) -> list[PromptRecord]:
        """``count`` prompts to generate: queued ones first, then new ones from ``sampler`` (counted as drawn)."""
        records = [self.queued.popleft() for _ in range(min(len(self.queued), count))]
        if len(records) < count:
            drawn = sampler.next_batch(count - len(records))
            self.ledger.drawn += len(drawn)
            records += drawn
        return records

    def submit(self, record: PromptRecord, version: int) -> tuple[str, int]:
        """``record`` goes out as a request while the engine serves ``version``: the request's id, and its number
        (what seeds its samples)."""
        number = self._next_request
        self._next_request += 1
        request_id = f"r{number}"
        self._in_flight[request_id] = (record, version)
        return request_id, number

    def record(self, request_id: str) -> PromptRecord:
        return self._in_flight[request_id][0]

    def is_aborting(self, request_id: str) -> bool:
        return request_id in self._aborting

    def abort_submitted_before(self, version: int) -> list[str]:
        """The ids of live requests submitted before ``version``, now aborting."""
        doomed = [rid for rid, (_, submitted) in self._in_flight.items()
                  if submitted < version and rid not in self._aborting]
        self._aborting.update(doomed)
        return doomed

    def returned(self, request_id: str) -> PromptRecord:
        """The request came back (finished or aborted): its prompt is no longer in flight."""
        record, _ = self._in_flight.pop(request_id)
        self._aborting.discard(request_id)
        return record

    def requeue(self, record: PromptRecord) -> None:
        """Generate ``record`` again, before anything else."""
        self.queued.appendleft(record)
        self.ledger.requeued += 1

    def take_regenerated(self) -> int | None:
        """After a resume: how many prompts it queued again, once; None afterwards."""
        regenerated, self._regenerated = self._regenerated, None
        return regenerated

    # ---- checkpoint -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"pending_prompts": list(self.queued) + self.in_flight_records(), "ledger": asdict(self.ledger)}

    def load_state_dict(self, state: dict) -> None:
        """The prompts a checkpoint (of either mode) held queued or in flight are queued; the ledger continues."""
        pending = list(state.get("pending_prompts", []))
        self.queued = deque(pending)
        if "ledger" in state:
            self.ledger = PromptLedger(**state["ledger"])
        else:  # a sync checkpoint keeps no ledger: start the books from the groups it holds
            self.ledger = PromptLedger(drawn=len(state["buffer"]["groups"]))
        self.ledger.regenerated_after_resume += len(pending)
        self._regenerated = len(pending)

