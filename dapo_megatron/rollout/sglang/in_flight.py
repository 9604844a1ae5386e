"""How many samples the SGLang engine keeps on its servers at once, whatever the requests carry.

A server decodes up to its running-request limit of sequences at once, one per sample (SGLang 0.5.23 splits an
``n``-sample request into ``n`` sequences), so the engine's limit is counted in samples
(``rollout.sglang.max_in_flight_samples``, by default the servers' limits summed:
:func:`dapo_megatron.rollout.sglang.pool.in_flight_samples`). Counted in requests of ``rollout.n_samples``, a
multi-turn rollout — whose every turn after the first is a request of one sample — kept 1/n of the servers busy.

:class:`SampleBudget` is that count, shared by the engine's batch generation and its streamed requests: a request
takes its samples before it is sent and gives them back when its reply is in.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator


class SampleBudget:
    """At most ``limit`` samples in flight. A request of more samples than the limit runs alone (it would never fit
    otherwise); requests wait for room in the order they asked."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a sample budget needs room for at least one sample, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self.peak = 0  # the most samples in flight at once so far (what a GPU check reports)
        self._changed = threading.Condition()
        self._queue: list[object] = []
        self._on_room: list[Callable[[], None]] = []  # told whenever samples are given back

    @contextmanager
    def taken(self, samples: int) -> Iterator[None]:
        """Wait until ``samples`` more fit, hold them for the block."""
        ticket = object()
        with self._changed:
            self._queue.append(ticket)
            self._changed.wait_for(lambda: self._queue[0] is ticket and self._fits(samples))
            self._queue.pop(0)
            self.in_flight += samples
            self.peak = max(self.peak, self.in_flight)
            self._changed.notify_all()
        try:
            yield
        finally:
            self.give_back(samples)

    def try_take(self, samples: int) -> bool:
        """Take ``samples`` now if they fit and nobody waits before them (then :meth:`give_back` them); else False."""
        with self._changed:
            if self._queue or not self._fits(samples):
                return False
            self.in_flight += samples
            self.peak = max(self.peak, self.in_flight)
            return True

    def give_back(self, samples: int) -> None:
        with self._changed:
            self.in_flight -= samples
            self._changed.notify_all()
        for callback in self._on_room:
            callback()

    def when_room(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (outside the budget's lock) each time samples are given back: who waits without a thread
        (:meth:`try_take`) tries again then."""
        self._on_room.append(callback)

    def _fits(self, samples: int) -> bool:
        return self.in_flight == 0 or self.in_flight + samples <= self.limit

    def requests_at_once(self, samples_per_request: int) -> int:
        """Requests of ``samples_per_request`` samples that fill the budget (threads to send them with)."""
        return max(1, -(-self.limit // samples_per_request))
