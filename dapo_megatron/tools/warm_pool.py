"""Sandboxes started ahead of demand: each runs exactly one call and then dies, but its start (namespaces, mounts,
the interpreter's own start) is paid before the call arrives.

One thread owns every sandbox process of a :class:`~dapo_megatron.tools.sandbox.CodeSandbox`, the cold ones too:
the fresh session keyring each gets is joined by that thread, and bubblewrap's ``--die-with-parent`` follows the
thread that forked it, so the thread lives as long as the pool. It keeps ``size`` sandboxes waiting (``size`` 0:
none; each call then waits for its own start) and starts one more for each call that finds none waiting.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Generic, Protocol, TypeVar

RETRY_S = 1.0  # a failed start is retried after this, or at once for a call that comes to wait


class Closable(Protocol):
    def close(self) -> None: ...


Item = TypeVar("Item", bound=Closable)


class PoolClosed(Exception):
    """The pool was closed while a call waited for a sandbox."""


class _Failed:
    def __init__(self, error: Exception):
        self.error = error


class WarmPool(Generic[Item]):
    """Taken sandboxes are the caller's to run and end; the caller says :meth:`finished` when one is, and the
    thread stays until every sandbox it started has ended: bubblewrap's ``--die-with-parent`` would kill one still
    running when the thread exits, abruptly (its init orphaned, left a zombie wherever it lands)."""

    def __init__(self, start: Callable[[], Item], size: int, name: str = "dapo-sandbox-start"):
        self._start = start
        self._size = size
        self._ready: collections.deque[Item | _Failed] = collections.deque()
        self._waiting = 0  # calls waiting for a sandbox
        self._live = 0  # sandboxes started and not yet ended: waiting in _ready, or taken
        self._closed = False
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._fill, name=name, daemon=True)
        self._thread.start()

    def take(self) -> Item:
        """A started sandbox, the caller's to run one call in (then :meth:`finished`); raises the error of a start
        that failed."""
        with self._condition:
            self._waiting += 1
            self._condition.notify_all()
            try:
                while not self._ready and not self._closed:
                    self._condition.wait()
                if self._closed:
                    raise PoolClosed("the code sandbox is closed")
                item = self._ready.popleft()
            finally:
                self._waiting -= 1
            self._condition.notify_all()  # the filler starts the next
        if isinstance(item, _Failed):
            raise item.error
        return item

    def finished(self) -> None:
        """A sandbox taken from the pool has ended (its processes are gone)."""
        with self._condition:
            self._live -= 1
            self._condition.notify_all()

    def ready(self) -> int:
        """How many started sandboxes are waiting for a call."""
        with self._condition:
            return sum(not isinstance(item, _Failed) for item in self._ready)

    def close(self) -> None:
        """Stop starting sandboxes, end the ones waiting, and wait for the calls running in taken ones to finish."""
        with self._condition:
            self._closed = True
            waiting = [item for item in self._ready if not isinstance(item, _Failed)]
            self._ready.clear()
            self._condition.notify_all()
        for item in waiting:
            item.close()
            self.finished()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _wanted(self) -> bool:
        failed = sum(isinstance(item, _Failed) for item in self._ready)
        return len(self._ready) - failed < self._size + max(self._waiting - failed, 0)

    def _fill(self) -> None:
        while True:
            with self._condition:
                while not self._closed and not self._wanted():
                    self._condition.wait()
                if self._closed:
                    break
            try:
                item: Item | _Failed = self._start()
            except Exception as error:  # handed to a call waiting for it; the pool goes on
                item = _Failed(error)
            failed = isinstance(item, _Failed)
            with self._condition:
                if self._closed:
                    if not failed:
                        item.close()
                    break
                if not failed:
                    self._live += 1
                    self._ready.append(item)
                elif self._waiting > sum(isinstance(i, _Failed) for i in self._ready):
                    self._ready.append(item)  # one waiting call gets the error; with none waiting it is retried
                self._condition.notify_all()
                if failed:
                    self._condition.wait(RETRY_S)
        with self._condition:
            while self._live > 0:
                self._condition.wait()
