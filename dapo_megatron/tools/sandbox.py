"""The built-in ``python`` tool: a code block run in a sandbox, answered with its stdout+stderr.

Isolation ``bubblewrap`` (the default; docs/tools-sandbox.md): each call is one ``bwrap`` process that unshares
every namespace (user, pid, network, ipc, uts, cgroup), clears the environment, shows ``/usr`` (and the
``ro_paths``) read-only on an otherwise empty, read-only root, gives the code fresh tmpfs folders as its working
folder and ``/tmp`` (sized, gone after the call), ends with the trainer (``--die-with-parent``) and runs the
interpreter under ``prlimit`` (CPU, address space, processes, open files, file size). The limits are set inside
the call's user namespace, so its process count is its own; RLIMIT_NPROC is never enforced for root, so a trainer
running as root starts ``bwrap`` as ``sandbox.uid`` instead.

The sandbox is checked when it is built: bwrap, prlimit and the interpreter must be there and one call must run;
otherwise it refuses to start (:class:`ToolsError`) and names the opt-out, ``isolation: none_i_accept_the_risk``,
which runs the code as a plain process under the same rlimits, wall time and output cap in a temporary folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from dapo_megatron.config.tools import OPT_OUT, PREFIX, SandboxConfig, ToolsError
from dapo_megatron.tools.process import run_process
from dapo_megatron.tools.result import ToolResult
from dapo_megatron.tools.tool import CodeRunner

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
        if self.isolation == "bubblewrap":
            self._check_python_visible()
            self._bwrap = _find_bwrap(sandbox.bwrap)
            self._nested_userns_flag = _supports(self._bwrap, "--disable-userns")
            self._probe()

    def run(self, code: str) -> ToolResult:
        """Run ``code`` (a whole Python program, read from stdin by the interpreter)."""
        data = code.encode("utf-8", errors="replace")
        if self.isolation == "bubblewrap":
            return run_process(self.tool, self._bwrap_argv(), stdin=data, env=ENV, user=self._user,
                               wall_s=self.limits.wall_s, output_bytes=self.limits.output_bytes, signal_base=128)
        folder = tempfile.mkdtemp(prefix="dapo-tool-")
        try:
            return run_process(self.tool, self._limited_python(), stdin=data, cwd=folder,
                               env={**ENV, "HOME": folder, "TMPDIR": folder},
                               wall_s=self.limits.wall_s, output_bytes=self.limits.output_bytes)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ argv

    def _limited_python(self) -> list[str]:
        limits = self.limits
        return [self._prlimit, f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.memory_mb << 20}",
                f"--nproc={limits.processes}", f"--nofile={limits.open_files}", f"--fsize={limits.file_mb << 20}",
                "--", self.config.python, "-I", "-"]

    def _bwrap_argv(self) -> list[str]:
        workdir_bytes = str(self.limits.workdir_mb << 20)
        argv = [self._bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv",
                "--ro-bind", "/usr", "/usr"]
        for path in SYSTEM_LINKS:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        for path in self.config.ro_paths:
            argv += ["--ro-bind", path, path]
        argv += ["--proc", "/proc", "--dev", "/dev",
                 "--size", workdir_bytes, "--tmpfs", "/tmp",
                 "--size", workdir_bytes, "--tmpfs", WORKDIR,
                 "--setenv", "HOME", WORKDIR, "--setenv", "TMPDIR", "/tmp", "--chdir", WORKDIR,
                 "--remount-ro", "/", "--remount-ro", "/dev"]  # their tmpfs would take writes without a bound
        if self._nested_userns_flag:
            argv.append("--disable-userns")
        for name, value in ENV.items():
            argv += ["--setenv", name, value]
        return [*argv, "--", *self._limited_python()]

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
        result = run_process(self.tool, self._bwrap_argv(), stdin=PROBE.encode(), env=ENV, user=self._user,
                             wall_s=PROBE_WALL_S, output_bytes=self.limits.output_bytes, signal_base=128)
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
