"""The embedded engine's gate between decode steps and weight updates.

Every decode step (forward + sampling) runs inside ``gate.step()``; ``update_weights`` runs inside
``gate.exclusive()``, which waits for the steps in progress to end and holds new ones back until the weights are
swapped. A decode loop that finds the version changed when it enters its next step re-prefills its prompt and tokens
so far with the new weights (:meth:`.decode_chunk.DecodingChunk.re_prefill`), so every later
token is sampled by the new weights alone.

The engine takes its gate as a constructor argument: a test passes a subclass whose ``step`` holds the loop at a
chosen step, which makes "an update arrives while requests are in flight" deterministic.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


class WeightGate:
    """Decode steps run concurrently with each other, never with a weight update (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active_steps = 0
        self._updating = False

    @contextmanager
    def step(self) -> Iterator[None]:
        with self._cond:
            while self._updating:
                self._cond.wait()
            self._active_steps += 1
        try:
            yield
        finally:
            with self._cond:
                self._active_steps -= 1
                self._cond.notify_all()

    def when_settled(self, read: Callable[[], T]) -> T:
        """``read()`` at a moment no weight update is in progress (waiting for one to end)."""
        with self._cond:
            while self._updating:
                self._cond.wait()
            return read()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._updating:
                self._cond.wait()
            self._updating = True  # from here on no step starts
            while self._active_steps:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()

    @property
    def updating(self) -> bool:
        """A weight update holds the gate or waits for the steps in progress to end."""
        with self._cond:
            return self._updating
