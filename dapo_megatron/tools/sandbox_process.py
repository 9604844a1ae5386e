"""One sandbox process: started (:func:`start_sandbox`), then given exactly one code block to run
(:meth:`StartedSandbox.run`), then gone: its processes, its cgroup and its keyring.

Starting one, in the thread that owns it (the warm pool's, :mod:`dapo_megatron.tools.warm_pool`):

1. the thread joins a fresh session keyring (:mod:`dapo_megatron.tools.keyring`), which the sandbox inherits;
2. ``/bin/sh`` starts in a session of its own and waits for a line on its stdin, so that
3. the trainer can move it into the call's cgroup (:mod:`dapo_megatron.tools.cgroups`) before it runs anything;
4. the line sent, it becomes ``bwrap`` (through ``setpriv`` to ``sandbox.uid`` when the trainer is root), which
   reads the seccomp filter from a pipe (:mod:`dapo_megatron.tools.seccomp`) and starts the sandbox's command:
   its init, then the interpreter, which waits for the code on its stdin (``python -I -``).

Running it writes the code and reads the output under the wall time, the output cap and the cgroup's CPU time and
OOM count (:func:`dapo_megatron.tools.process.finish_process`).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass

from dapo_megatron.config.tools import SandboxLimits
from dapo_megatron.tools.cgroups import CallCgroup, CallCgroups
from dapo_megatron.tools.keyring import join_fresh_session_keyring
from dapo_megatron.tools.process import Stop, finish_process
from dapo_megatron.tools.result import ToolResult, failure

SHELL = "/bin/sh"
SETPRIV = "/usr/bin/setpriv"
# Holds the process until the trainer has put it into its cgroup; `read` takes the line one byte at a time, so the
# code after it stays in the pipe for the interpreter.
HOLD = 'read -r _ || exit 125; exec "$@"'
START_S = 30.0  # bwrap reports its sandbox within milliseconds; this bounds a machine under heavy load
EXIT_S = 5.0  # a killed sandbox is gone within milliseconds; this bounds a machine under heavy load


@dataclass(frozen=True)
class SandboxCommand:
    """What every sandbox of a :class:`~dapo_megatron.tools.sandbox.CodeSandbox` runs: ``bwrap`` with
    ``options``, then ``command``; ``uid``: who it runs as (None: the trainer's uid)."""

    bwrap: str
    options: list[str]
    command: list[str]
    env: dict[str, str]
    seccomp: bytes  # the filter, as bubblewrap reads it
    uid: int | None
    limits: SandboxLimits


class StartedSandbox:
    """A sandbox that is waiting for its code; runs one call, then is gone.

    It is ended by killing its init (pid 1 of its namespace, by a pidfd: never another process that got the
    number), which ends every process in it; bubblewrap's outer process then reaps that init and exits. Killing
    the outer process first would leave the init an orphan: a zombie wherever its new parent does not reap (a
    trainer that is a child subreaper, a container's PID 1; issue 41)."""

    def __init__(self, process: subprocess.Popen, cgroup: CallCgroup | None, info_read: int):
        self.process = process
        self.cgroup = cgroup
        self._info_read: int | None = info_read  # where bwrap reports its init's pid, read when first needed
        self._init_pidfd: int | None = None

    def run(self, tool: str, code: bytes, limits: SandboxLimits, start: float) -> ToolResult:
        """Run ``code``; ``start``: when the call arrived (the wall time it reports counts from there)."""
        cgroup, cpu_before = self.cgroup, self.cgroup.cpu_seconds() if self.cgroup else 0.0

        def watch() -> Stop | None:
            if cgroup.oom_kills():
                return Stop("memory", f"memory limit: the call's processes held more than {limits.memory_mb} MB "
                                      "together; killed")
            if cgroup.cpu_seconds() - cpu_before > limits.cpu_s:
                return Stop("timeout", f"timeout: the call's processes used more than {limits.cpu_s} s of CPU "
                                       "time together; killed")
            return None

        try:
            self._find_init()  # while the sandbox waits for its code: its init cannot have exited yet
            result = finish_process(tool, self.process, code, start=start, wall_s=limits.wall_s,
                                    output_bytes=limits.output_bytes, signal_base=128,
                                    watch=watch if cgroup else None, kill=self._kill)
            if cgroup is not None and result.kind not in ("memory", "output_limit") and cgroup.oom_kills():
                result = failure(tool, "memory", f"{result.text}\n[memory limit: the call's processes held more "
                                 f"than {limits.memory_mb} MB together; one was killed]", result.wall_s,
                                 result.exit_code)
        finally:
            self.close()
        return result

    def close(self) -> None:
        """End it (whatever still runs is killed) and remove its cgroup."""
        if self.process.returncode is None:
            self._kill(self.process)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
        for fd in (self._info_read, self._init_pidfd):
            if fd is not None:
                os.close(fd)
        self._info_read = self._init_pidfd = None
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None

    def _find_init(self) -> None:
        if self._info_read is not None:
            try:
                self._init_pidfd = _init_pidfd(self._info_read)
            finally:
                os.close(self._info_read)
                self._info_read = None

    def _kill(self, process: subprocess.Popen) -> None:
        try:
            self._find_init()
        except (OSError, TimeoutError):
            pass  # no pidfd: the process group below
        if self._init_pidfd is not None:
            try:
                signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
                process.wait(timeout=EXIT_S)
                return
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass  # gone already, or the outer process did not follow: end it too
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            pass


def start_sandbox(command: SandboxCommand, cgroups: CallCgroups | None) -> StartedSandbox:
    """Start a sandbox that waits for its code (see the module's docstring); in the thread that will own it."""
    join_fresh_session_keyring()
    cgroup = cgroups.create() if cgroups is not None else None
    seccomp_read, seccomp_write = os.pipe()
    info_read, info_write = os.pipe()
    try:
        os.write(seccomp_write, command.seccomp)  # a few hundred bytes: the pipe holds them
        os.close(seccomp_write)
        if cgroup is not None:
            # bwrap's outer process counts too: one process more than the namespace's own limit
            cgroup.limit(command.limits.memory_mb << 20, command.limits.processes + 1)
        launcher = [SETPRIV, f"--reuid={command.uid}", f"--regid={command.uid}", "--clear-groups", "--"] \
            if command.uid is not None else []
        argv = [SHELL, "-c", HOLD, "sandbox", *launcher, command.bwrap, "--seccomp", str(seccomp_read),
                "--info-fd", str(info_write), *command.options, "--", *command.command]
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   env=command.env, start_new_session=True, close_fds=True,
                                   pass_fds=[seccomp_read, info_write])
    except BaseException:
        os.close(info_read)
        if cgroup is not None:
            cgroup.remove()
        raise
    finally:
        os.close(seccomp_read)
        os.close(info_write)
    sandbox = StartedSandbox(process, cgroup, info_read)
    try:
        if cgroup is not None:
            cgroup.attach(process.pid)
        os.write(process.stdin.fileno(), b"\n")
    except BaseException:
        sandbox.close()
        raise
    return sandbox


def _init_pidfd(info_read: int) -> int | None:
    """A pidfd of the sandbox's init, from the JSON bwrap writes to ``--info-fd`` (``{"child-pid": N, ...}``) once
    it has made it; None if bwrap ended before (its exit status says why when the call runs)."""
    data, deadline = b"", time.monotonic() + START_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"bubblewrap did not start its sandbox within {START_S:g} s")
        ready, _, _ = select.select([info_read], [], [], left)
        chunk = os.read(info_read, 4096) if ready else b""
        if ready and chunk:
            data += chunk
            continue
        if ready:  # EOF: bwrap wrote all it had
            break
    try:
        pid = json.loads(data)["child-pid"]
        return os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, ProcessLookupError):
        return None
