"""How a ``train`` process stops on a signal, and the exit code each way of stopping ends it with.

* **SIGTERM, SIGUSR1, SIGHUP** (SLURM sends SIGTERM at a job's time limit, on preemption and on ``scancel``;
  ``sbatch --signal=USR1@120`` sends SIGUSR1 ahead of it; a closed terminal or ssh session sends SIGHUP): once the
  training loop runs, the step in progress is finished, a checkpoint of it is written (unless that step just wrote
  one) and the run exits with :data:`STOPPED_EXIT_CODE`; ``--resume`` continues exactly there. Every rank reaches
  the same decision at the same step (:meth:`StopSignals.agreed_stop` is a collective), so a signal that reached
  one rank stops them all. Before the loop (loading, warm start, starting servers) there is nothing to save: the run
  stops at once, with the same code. A second such signal while the step finishes stops at once with
  :data:`TERMINATED_EXIT_CODE`; the newest complete checkpoint is then the one before.
* **SIGINT** (Ctrl-C): stops at once with :data:`INTERRUPTED_EXIT_CODE` — except inside a :meth:`StopSignals.protected`
  section (a checkpoint being written, which takes about as long as the process's own exit would: megatron's writer
  processes are waited for either way), which is finished first; a second Ctrl-C abandons it (its ``.tmp`` folder is
  ignored by ``--resume``).

Output never stops a run: while the handlers are installed, stdout and stderr survive their reader (``| tee``
killed with the rest of the process group, a closed terminal) by going on in the run directory's ``console.log``
(:mod:`.console`).

Processes forked from the trainer (megatron-core's checkpoint writer processes) inherit these handlers and ignore
the signals: the trainer alone decides, and a writer interrupted half-way would leave its parent waiting forever
for it (megatron's ``count_queue.join()``).

Raising from a signal handler is not always heard: Python drops an exception raised inside a finalizer, a weakref
callback or an at-fork hook. So every stop is also remembered, and :meth:`StopSignals.agreed_stop` and the end of a
protected section raise it again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Iterator

from dapo_megatron.run.console import keep_writing

logger = logging.getLogger(__name__)

STOPPED_EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: stopped on request, nothing lost; `--resume` continues
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
TERMINATED_EXIT_CODE = 143  # 128 + SIGTERM: stopped at once by a second signal; steps since the last checkpoint lost
SAVE_THEN_STOP = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


class StopNow(BaseException):
    """Raised in the main thread to end the run at once. A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way mistakes it for a failure of the work it interrupts."""

    def __init__(self, signum: int, exit_code: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum, self.exit_code = signum, exit_code


class StopSignals:
    """The stop-signal handlers of one process, installed by ``with StopSignals() as stop:`` in its main thread
    (a StopSignals that is not entered handles nothing and never asks to stop)."""

    def __init__(self) -> None:
        self.save_requested: int | None = None  # SIGTERM/USR1/HUP: checkpoint at the end of the step, then stop
        self._stop: BaseException | None = None  # a stop raised (or to be raised) in the main thread
        self._owner = os.getpid()
        self._in_loop = False
        self._protected: list[str] = []  # what the sections being finished do, innermost last
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            keep_writing()
            for signum in (signal.SIGINT, *SAVE_THEN_STOP):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    # -------------------------------------------------------------------------------------------- the handler

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._owner:  # a forked checkpoint writer: let it finish, the trainer decides
            return
        name = signal.Signals(signum).name
        if signum in SAVE_THEN_STOP and self._in_loop and self.save_requested is None and self._stop is None:
            self.save_requested = signum
            logger.warning("%s: stopping after the step in progress, with a checkpoint of it (send it again to "
                           "stop at once, without one)", name)
            return
        if signum == signal.SIGINT:
            stop: BaseException = KeyboardInterrupt()
        else:
            nothing_lost = not self._in_loop  # before the loop, no step has been trained since the last checkpoint
            stop = StopNow(signum, STOPPED_EXIT_CODE if nothing_lost else TERMINATED_EXIT_CODE)
        if self._protected and self._stop is None:
            self._stop = stop
            logger.warning("%s: %s first (press Ctrl-C again to abandon it)", name, self._protected[-1])
            return
        self._stop = stop
        raise stop

    # -------------------------------------------------------------------------------------------- the loop's side

    @contextlib.contextmanager
    def training_loop(self) -> Iterator[None]:
        """While the training loop runs, SIGTERM/SIGUSR1 wait for the end of the step in progress."""
        self._in_loop = True
        try:
            self._raise_pending()
            yield
        finally:
            self._in_loop = False

    @contextlib.contextmanager
    def protected(self, what: str) -> Iterator[None]:
        """A section a first Ctrl-C (or an immediate stop) lets finish; the stop is raised at its end. ``what``: what
        the section does, for the message (``finishing checkpoint 12``)."""
        self._protected.append(what)
        try:
            yield
        finally:
            self._protected.pop()
        if not self._protected:
            self._raise_pending()

    def agreed_stop(self) -> int | None:
        """Whether to save and stop now: the signal (SIGTERM, SIGUSR1 or SIGHUP) that any rank received, else None. A
        collective: every rank calls it at the end of every step."""
        # Imported here: the CLI imports this module for its exit codes, also for commands that never load torch.
        import torch
        import torch.distributed as dist

        from dapo_megatron.rank_zero import waiting_group

        self._raise_pending()
        wanted = torch.tensor([self.save_requested or 0], dtype=torch.int64)
        group = waiting_group()
        if group is not None:
            dist.all_reduce(wanted, op=dist.ReduceOp.MAX, group=group)
        return int(wanted.item()) or None

    def _raise_pending(self) -> None:
        if self._stop is not None:
            raise self._stop
