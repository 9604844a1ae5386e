"""Run one process to the end under a wall time and an output cap, and read how it ended as a :class:`ToolResult`.

The process starts in a session of its own, so that on a timeout or past the output cap the whole group is
killed (for the sandbox that is bubblewrap, whose death ends the call's pid namespace and everything in it).
stdout and stderr share one pipe, so the model reads them interleaved as a terminal would show them; the pipe is
read as it fills (a 100 MB print never sits in the trainer's memory: reading stops at the cap, the call is killed).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from dapo_megatron.tools.result import ToolResult, failure

FAULT_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE, signal.SIGSYS}
READ_CHUNK = 65536
WATCH_S = 0.05  # how often a watch (the sandbox's CPU time and memory of the whole call) is asked


@dataclass(frozen=True)
class Stop:
    """Why a call was ended before its process exited: a failure kind and the note the model reads."""

    kind: str
    note: str


def run_process(tool: str, argv: list[str], *, wall_s: float, output_bytes: int, stdin: bytes = b"",
                cwd: str | None = None, env: dict | None = None, user: int | None = None,
                signal_base: int = 0, stderr_to_output: bool = True) -> ToolResult:
    """Run ``argv``; its stdout+stderr (the first ``output_bytes``) as the text (``stderr_to_output=False``: its
    stderr goes to the trainer's). ``signal_base``: the status a launcher reports for a child ended by signal
    ``n`` is ``signal_base + n`` (bubblewrap: 128); without a launcher the signal comes from the process itself."""
    start = time.monotonic()
    user_args = {"user": user, "group": user, "extra_groups": []} if user is not None else {}
    try:
        process = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT if stderr_to_output else None,
                                   cwd=cwd, env=env, start_new_session=True, close_fds=True, **user_args)
    except OSError as error:
        return failure(tool, "crashed", f"[the tool process did not start: {error}]", time.monotonic() - start)
    return finish_process(tool, process, stdin, start=start, wall_s=wall_s, output_bytes=output_bytes,
                          signal_base=signal_base)


def finish_process(tool: str, process: subprocess.Popen, stdin: bytes, *, start: float, wall_s: float,
                   output_bytes: int, signal_base: int = 0, watch: Callable[[], Stop | None] | None = None,
                   kill: Callable[[subprocess.Popen], None] | None = None) -> ToolResult:
    """Feed ``stdin`` to a started process (in a session of its own, stdout a pipe) and read it to its end, at
    most ``wall_s`` from now. ``watch``, if given, is asked every :data:`WATCH_S` while it runs; a :class:`Stop`
    it returns ends the call with that kind and note. ``kill`` ends a call stopped early (default: SIGKILL to the
    process group). ``start``: when the call began, for the wall time reported."""
    kill = kill or _kill_group
    deadline = time.monotonic() + wall_s
    try:
        output, stop = _communicate(process, stdin, deadline, output_bytes, watch, _timeout(wall_s))
        if stop is not None:
            kill(process)
        status = process.wait()
    except BaseException:
        kill(process)
        process.wait()
        raise
    finally:
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
    wall = time.monotonic() - start
    text = output[:output_bytes].decode("utf-8", errors="replace")
    if stop is not None:
        return failure(tool, stop.kind, f"{text}\n[{stop.note}]", wall)
    return _ended(tool, text, status, signal_base, wall)


def _communicate(process: subprocess.Popen, stdin: bytes, deadline: float, cap: int,
                 watch: Callable[[], Stop | None] | None, timeout: Stop) -> tuple[bytes, Stop | None]:
    """Feed ``stdin`` and read the output until EOF, the deadline or one byte past the cap, without blocking on
    either pipe (a process that neither reads nor exits must not hold the caller past the deadline); and why
    reading stopped early, if it did."""
    chunks, size, sent = [], 0, 0
    out_fd = process.stdout.fileno()
    in_fd = process.stdin.fileno() if process.stdin is not None else None
    with selectors.DefaultSelector() as selector:
        selector.register(out_fd, selectors.EVENT_READ)
        if in_fd is not None:
            os.set_blocking(in_fd, False)
            selector.register(in_fd, selectors.EVENT_WRITE)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), timeout
            stop = watch() if watch is not None else None
            if stop is not None:
                return b"".join(chunks), stop
            for key, _ in selector.select(timeout=min(left, WATCH_S) if watch is not None else left):
                if key.fd == in_fd:
                    try:
                        sent += os.write(in_fd, stdin[sent:sent + READ_CHUNK])
                    except BrokenPipeError:  # it exited without reading its input: its status says why
                        sent = len(stdin)
                    if sent >= len(stdin):
                        selector.unregister(in_fd)
                        process.stdin.close()
                        in_fd = None
                    continue
                chunk = os.read(out_fd, READ_CHUNK)
                if not chunk:  # EOF: every writer is gone
                    return b"".join(chunks), _wait(process, deadline, watch, timeout)
                chunks.append(chunk)
                size += len(chunk)
                if size > cap:
                    return b"".join(chunks), Stop("output_limit",
                                                  f"output limit: more than {cap} bytes of output; killed")


def _wait(process: subprocess.Popen, deadline: float, watch: Callable[[], Stop | None] | None, timeout: Stop
          ) -> Stop | None:
    # The output is closed, but the process may still run (it closed its stdout): the deadline and the watch
    # still hold.
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        try:
            process.wait(timeout=min(left, WATCH_S) if watch is not None else left)
            return None
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                return timeout
        stop = watch()
        if stop is not None:
            return stop


def _timeout(wall_s: float) -> Stop:
    return Stop("timeout", f"timeout: still running after {wall_s:g} s wall time; killed")


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.kill()
    except ProcessLookupError:
        pass


def _ended(tool: str, text: str, status: int, signal_base: int, wall: float) -> ToolResult:
    if status < 0:  # Popen's way of saying "ended by signal -status"
        signum = -status
    elif signal_base and signal_base < status <= signal_base + signal.SIGRTMAX:
        signum = status - signal_base
    else:
        signum = None
    code = 128 + signum if signum is not None else status
    if signum is None:
        if status == 0:
            return ToolResult(tool, text, True, None, wall, 0)
        if last_line(text).startswith("MemoryError"):
            return failure(tool, "memory", f"{text}\n[memory limit: an allocation failed]", wall, code)
        return failure(tool, "error", f"{text}\n[exit status {status}]", wall, code)
    name = _signal_name(signum)
    if signum == signal.SIGXCPU:  # the soft CPU limit (the hard one, a second later, is a SIGKILL)
        return failure(tool, "timeout", f"{text}\n[timeout: CPU time limit reached ({name})]", wall, code)
    if signum in FAULT_SIGNALS:
        return failure(tool, "crashed", f"{text}\n[crashed: {name}]", wall, code)
    return failure(tool, "killed", f"{text}\n[killed by {name}]", wall, code)


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
