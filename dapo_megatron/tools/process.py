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

from dapo_megatron.tools.result import ToolResult, failure

FAULT_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE, signal.SIGSYS}
READ_CHUNK = 65536


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
    try:
        output, stop = _communicate(process, stdin, start + wall_s, output_bytes)
        if stop is not None:
            _kill_group(process)
        status = process.wait()
    except BaseException:
        _kill_group(process)
        process.wait()
        raise
    finally:
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
    wall = time.monotonic() - start
    text = output[:output_bytes].decode("utf-8", errors="replace")
    if stop == "timeout":
        return failure(tool, "timeout", f"{text}\n[timeout: still running after {wall_s:g} s wall time; killed]",
                       wall)
    if stop == "output_limit":
        return failure(tool, "output_limit",
                       f"{text}\n[output limit: more than {output_bytes} bytes of output; killed]", wall)
    return _ended(tool, text, status, signal_base, wall)


def _communicate(process: subprocess.Popen, stdin: bytes, deadline: float, cap: int
                 ) -> tuple[bytes, str | None]:
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
                return b"".join(chunks), "timeout"
            for key, _ in selector.select(timeout=left):
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
                    return _wait(process, b"".join(chunks), deadline)
                chunks.append(chunk)
                size += len(chunk)
                if size > cap:
                    return b"".join(chunks), "output_limit"


def _wait(process: subprocess.Popen, output: bytes, deadline: float) -> tuple[bytes, str | None]:
    # The output is closed, but the process may still run (it closed its stdout): the deadline still holds.
    try:
        process.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        return output, "timeout"
    return output, None


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
