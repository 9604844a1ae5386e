"""The built-in ``python`` tool: a code block run in a sandbox, answered with its stdout+stderr.

Isolation ``bubblewrap`` (the default; docs/tools-sandbox.md): each call runs in one ``bwrap`` sandbox of its own
that unshares every namespace (user, pid, network, ipc, uts, cgroup), clears the environment, shows ``/usr`` (and
the ``ro_paths``) read-only on an otherwise empty, read-only root, gives the code fresh tmpfs folders as its working
folder, ``/tmp`` and ``/dev/shm`` (sized, gone after the call), ends with the trainer (``--die-with-parent``),
installs a seccomp filter (:mod:`dapo_megatron.tools.seccomp`), starts with a fresh session keyring
(:mod:`dapo_megatron.tools.keyring`) and runs the interpreter under ``prlimit``. Memory (shared memory included),
processes and CPU time hold for the call as a whole in a cgroup of its own (:mod:`dapo_megatron.tools.cgroups`;
``sandbox.cgroup: rlimits_only`` is the named weaker mode without one); the rlimits are the second line, set inside
the call's user namespace. RLIMIT_NPROC is never enforced for root, so a trainer running as root starts ``bwrap``
as ``sandbox.uid`` instead.

Sandboxes are started ahead of the calls (``sandbox.warm`` of them, :mod:`dapo_megatron.tools.warm_pool`); each
runs one call and is gone (:mod:`dapo_megatron.tools.sandbox_process`).

The sandbox is checked when it is built: bwrap, prlimit and the interpreter must be there, a cgroup must be
possible (unless ``rlimits_only``) and one call must run; otherwise it refuses to start (:class:`ToolsError`) and
names the opt-out, ``isolation: none_i_accept_the_risk``, which runs the code as a plain process under the same
rlimits, wall time and output cap in a temporary folder.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
import time
import weakref
from dataclasses import replace

from dapo_megatron.config.tools import OPT_OUT, PREFIX, RLIMITS_ONLY, SandboxConfig, ToolsError
from dapo_megatron.overrides.bubblewrap import sandbox_init as bubblewrap_init
from dapo_megatron.tools.cgroups import CallCgroups, CgroupUnavailable
from dapo_megatron.tools.process import run_process
from dapo_megatron.tools.result import ToolResult, failure
from dapo_megatron.tools.sandbox_process import SETPRIV, SandboxCommand, start_sandbox
from dapo_megatron.tools.seccomp import filter_program
from dapo_megatron.tools.tool import CodeRunner
from dapo_megatron.tools.warm_pool import PoolClosed, WarmPool

WORKDIR = "/sandbox"  # the code's working folder inside the sandbox
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # merged-/usr links, or folders elsewhere
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
PROBE = "import os\nprint('sandbox-ok', os.getuid())\n"
PROBE_WALL_S = 60.0  # the first call pays for cold caches; a working sandbox answers in well under a second


class CodeSandbox(CodeRunner):
    """Runs Python code blocks as configured by ``sandbox``; :meth:`run` never raises for what the code does. The
    python tool of the :class:`~dapo_megatron.tools.tool.Tool` protocol through :class:`CodeRunner`."""

    def __init__(self, sandbox: SandboxConfig, tool: str = "python"):
        self.config = sandbox
        self.tool = tool
        self.limits = sandbox.limits
        self.isolation = sandbox.isolation
        self._prlimit = _find_prlimit()
        self._user = sandbox.uid if os.geteuid() == 0 else None
        self._pool: WarmPool | None = None
        if self.isolation == "bubblewrap":
            self._check_python_visible()
            bwrap = _find_bwrap(sandbox.bwrap)
            if self._user is not None and not os.access(SETPRIV, os.X_OK):
                raise ToolsError(f"{PREFIX}.sandbox: {SETPRIV} (util-linux) is missing; a trainer running as root "
                                 f"starts the sandbox as {PREFIX}.sandbox.uid with it")
            command = SandboxCommand(bwrap, self._bwrap_options(_supports(bwrap, "--disable-userns")),
                                     bubblewrap_init.with_own_init(self._limited_python()), ENV, _seccomp_filter(),
                                     self._user, self.limits)
            cgroups = _call_cgroups(sandbox)
            self._pool = WarmPool(functools.partial(start_sandbox, command, cgroups), sandbox.warm)
            # Whoever drops the sandbox without close() still ends its waiting sandboxes and its cgroups, at the
            # latest when the trainer exits.
            self._release = weakref.finalize(self, _release, self._pool, cgroups)
            try:
                self._probe()
            except BaseException:
                self.close()
                raise

    def run(self, code: str) -> ToolResult:
        """Run ``code`` (a whole Python program, read from stdin by the interpreter)."""
        data = code.encode("utf-8", errors="replace")
        if self.isolation == "bubblewrap":
            start = time.monotonic()
            try:
                sandbox = self._pool.take()
            except PoolClosed:
                return failure(self.tool, "refused", "[the code sandbox is closed]", time.monotonic() - start)
            except Exception as error:
                return failure(self.tool, "crashed", f"[the sandbox did not start: {type(error).__name__}: "
                                                     f"{error}]", time.monotonic() - start)
            try:
                return sandbox.run(self.tool, data, self.limits, start)
            finally:
                self._pool.finished()
        folder = tempfile.mkdtemp(prefix="dapo-tool-")
        try:
            return run_process(self.tool, self._limited_python(), stdin=data, cwd=folder,
                               env={**ENV, "HOME": folder, "TMPDIR": folder},
                               wall_s=self.limits.wall_s, output_bytes=self.limits.output_bytes)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """End the sandboxes started ahead and remove the calls' cgroups; calls running finish first."""
        if self._pool is not None:
            self._release()

    def cleanup(self) -> None:
        """The :class:`~dapo_megatron.tools.tool.Tool` release (:meth:`ToolPool.close
        <dapo_megatron.tools.pool.ToolPool.close>` calls it): :meth:`close`."""
        self.close()

    # ------------------------------------------------------------------------------------------------ argv

    def _limited_python(self) -> list[str]:
        limits = self.limits
        return [self._prlimit, f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.memory_mb << 20}",
                f"--nproc={limits.processes}", f"--nofile={limits.open_files}", f"--fsize={limits.file_mb << 20}",
                "--", self.config.python, "-I", "-"]

    def _bwrap_options(self, nested_userns_flag: bool) -> list[str]:
        workdir_bytes = str(self.limits.workdir_mb << 20)
        argv = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv",
                *bubblewrap_init.OPTIONS, "--ro-bind", "/usr", "/usr"]
        for path in SYSTEM_LINKS:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
                 "--proc", "/proc", "--dev", "/dev",
                 "--size", workdir_bytes, "--tmpfs", "/tmp",
                 "--size", workdir_bytes, "--tmpfs", WORKDIR]
        for path in self.config.ro_paths:  # after the sandbox's own /tmp, which would hide a path under it
            argv += ["--ro-bind", path, path]
        argv += ["--setenv", "HOME", WORKDIR, "--setenv", "TMPDIR", "/tmp", "--chdir", WORKDIR,
                 "--remount-ro", "/", "--remount-ro", "/dev",  # their tmpfs would take writes without a bound
                 # POSIX semaphores and shared memory (multiprocessing's locks and queues) live in /dev/shm
                 "--size", workdir_bytes, "--tmpfs", "/dev/shm"]
        if nested_userns_flag:
            argv.append("--disable-userns")
        for name, value in ENV.items():
            argv += ["--setenv", name, value]
        return argv

    # ------------------------------------------------------------------------------------------------ checks

    def _check_python_visible(self) -> None:
        python = self.config.python
        shown = ["/usr", *self.config.ro_paths]
        for path in {python, os.path.realpath(python)}:
            if not any(path == root or path.startswith(root.rstrip("/") + "/") for root in shown):
                raise ToolsError(f"{PREFIX}.sandbox.python: {path} is not inside /usr or any of "
                                 f"{PREFIX}.sandbox.ro_paths {self.config.ro_paths}: the sandbox would not see it; "
                                 "add its installation folder to ro_paths")

    def _probe(self) -> None:
        start = time.monotonic()
        try:
            sandbox = self._pool.take()
        except Exception as error:
            raise ToolsError(f"{PREFIX}.sandbox.isolation=bubblewrap: the sandbox did not start: "
                             f"{type(error).__name__}: {error}; {_opt_out_hint()}") from None
        try:
            result = sandbox.run(self.tool, PROBE.encode(), replace(self.limits, wall_s=PROBE_WALL_S), start)
        finally:
            self._pool.finished()
        words = result.text.split()
        if not result.ok or len(words) != 2 or words[0] != "sandbox-ok":
            detail = result.text.strip().splitlines()[0] if result.text.strip() else f"{result.kind}"
            raise ToolsError(f"{PREFIX}.sandbox.isolation=bubblewrap: a test call in the sandbox failed: {detail} "
                             f"(as uid {self._user if self._user is not None else os.geteuid()}); "
                             f"{_opt_out_hint()}")
        if words[1] == "0":
            raise ToolsError(f"{PREFIX}.sandbox.isolation=bubblewrap: the sandboxed code runs as root, so its "
                             f"process limit would not hold; {_opt_out_hint()}")


def _opt_out_hint() -> str:
    return (f"fix the sandbox (docs/tools-sandbox.md) or set {PREFIX}.sandbox.isolation={OPT_OUT} to run "
            "model-written code without isolation")


def _release(pool: WarmPool, cgroups: CallCgroups | None) -> None:
    pool.close()
    if cgroups is not None:
        cgroups.close()


def _call_cgroups(sandbox: SandboxConfig) -> CallCgroups | None:
    if sandbox.cgroup == RLIMITS_ONLY:
        return None
    try:
        return CallCgroups.find(sandbox.cgroup_parent)
    except CgroupUnavailable as error:
        raise ToolsError(f"{PREFIX}.sandbox.cgroup=per_call: no cgroup can be made for the calls: {error}; run the "
                         f"trainer as root, give it a delegated cgroup without processes of its own "
                         f"({PREFIX}.sandbox.cgroup_parent), or set {PREFIX}.sandbox.cgroup={RLIMITS_ONLY} to bound "
                         "each process on its own (docs/tools-sandbox.md)") from None


def _seccomp_filter() -> bytes:
    try:
        return filter_program()
    except ValueError as error:
        raise ToolsError(f"{PREFIX}.sandbox.isolation=bubblewrap: {error}; {_opt_out_hint()}") from None


def _find_bwrap(setting: str) -> str:
    path = shutil.which(setting)
    if path is None:
        raise ToolsError(f"{PREFIX}.sandbox.bwrap: bubblewrap not found at {setting!r}; install it "
                         f"(scripts/install_sandbox.sh, Debian package 'bubblewrap') or set "
                         f"{PREFIX}.sandbox.isolation={OPT_OUT} to run model-written code without isolation")
    return path


def _find_prlimit() -> str:
    # The sandbox shows /usr and the system links only, so prlimit must come from there.
    for path in ("/usr/bin/prlimit", "/bin/prlimit"):
        if os.access(path, os.X_OK):
            return path
    raise ToolsError(f"{PREFIX}.sandbox: /usr/bin/prlimit (util-linux) is missing; the sandbox sets its limits "
                     "with it")


def _supports(bwrap: str, flag: str) -> bool:
    completed = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
    return flag in completed.stdout + completed.stderr
