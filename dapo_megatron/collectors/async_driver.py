"""The async rollout driver's thread: it repeats one tick (submit, poll, take results) until stopped, and an error in
it reaches the trainer's thread instead of ending it silently."""

from __future__ import annotations

import threading
from typing import Callable

from dapo_megatron.rollout.engine import RolloutError
from dapo_megatron.user_errors import UserError


class DriverThread:
    """Runs ``tick()`` over and over in a daemon thread from :meth:`start` until :meth:`stop`. The first exception
    ends it; :meth:`check` raises it (as :class:`RolloutError`) in the caller's thread. ``cond`` guards the state the
    tick and its owner share: a failure notifies it, so an owner waiting on it wakes up to :meth:`check`."""

    def __init__(self, tick: Callable[[], None], cond: threading.Condition, name: str) -> None:
        self._tick = tick
        self._cond = cond
        self._name = name
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None

    def start(self) -> None:
        """Start the thread unless it was started before."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ask the thread to stop after its current tick and wait up to ``timeout_s`` for it."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def check(self) -> None:
        """Raise :class:`RolloutError` if the thread failed or died (a UserError as it is)."""
        if isinstance(self._error, UserError):  # bad input keeps its kind and exit code (a failing reward: 8)
            raise self._error
        if self._error is not None:
            raise RolloutError(f"the async rollout driver failed: {self._error}") from self._error
        if self._thread is not None and not self._thread.is_alive() and not self._stop:
            raise RolloutError("the async rollout driver thread died")

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stop:
                        return
                self._tick()
        except BaseException as error:  # noqa: BLE001 - raised by check() in the owner's thread
            with self._cond:
                self._error = error
                self._cond.notify_all()
