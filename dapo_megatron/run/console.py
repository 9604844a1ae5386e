"""A ``train`` process's stdout and stderr outlive their reader.

``dapo-megatron train ... | tee log`` sent SIGTERM as a group (a terminal's Ctrl-C or hangup, ``kill -- -PGID``,
systemd, a batch system signalling every process of a step) loses ``tee`` first; a closed terminal or ssh session
turns the tty's writes into EIO. Python ignores SIGPIPE, so the next ``print`` raised ``BrokenPipeError`` in the
middle of a step or of the stop's own checkpoint, and the run ended as a bug (exit 1) without its checkpoint; and a
failed flush at the interpreter's exit makes it exit 120.

:func:`keep_writing` wraps ``sys.stdout`` / ``sys.stderr`` (and the logging handlers writing to them) so that the
first write that fails points the stream's file descriptor at :func:`continue_in` 's file (the run directory's
``console.log``; ``/dev/null`` before a run directory is known) with ``dup2``, and writes the text there. Every
later write of this process and of the processes it starts, Python's exit flush included, then goes to that file:
the run, its stop and its checkpoint go on as if the reader were there.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

CONSOLE_LOG = "console.log"

_fallback: Path | None = None
_lock = threading.Lock()


def continue_in(path: str | Path | None) -> None:
    """Where output goes once its reader is gone (None: nowhere)."""
    global _fallback
    _fallback = Path(path) if path is not None else None


class SurvivingStream:
    """A text stream whose writes never fail for want of a reader."""

    def __init__(self, stream, name: str):
        self._stream, self._name = stream, name
        self.redirected_to: str | None = None

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            self._reader_gone(error)
            return self._stream.write(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            self._reader_gone(error)
            self._stream.flush()

    def _reader_gone(self, error: BaseException) -> None:
        with _lock:
            if self.redirected_to is not None:
                raise error  # the fallback itself fails: nothing is left to try
            target = str(_fallback) if _fallback is not None else os.devnull
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError:
                target, fd = os.devnull, os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(fd, self._stream.fileno())
            finally:
                os.close(fd)
            self.redirected_to = target
        self._stream.write(f"[dapo-megatron] {self._name}: its reader is gone ({type(error).__name__}: {error}); "
                           f"the rest of this output goes to {target}\n")

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def keep_writing() -> None:
    """Make this process's stdout and stderr survive their reader (idempotent; for the rest of the process)."""
    for name in ("stdout", "stderr"):
        current = getattr(sys, name)
        if current is None or isinstance(current, SurvivingStream):
            continue
        try:
            current.fileno()
        except (OSError, ValueError, AttributeError):  # not backed by a descriptor: nothing to redirect
            continue
        wrapped = SurvivingStream(current, name)
        setattr(sys, name, wrapped)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is current:
                handler.setStream(wrapped)
