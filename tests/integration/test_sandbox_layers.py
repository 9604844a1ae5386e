"""The sandbox's layers beyond its namespaces (issue 41): the seccomp filter as the sandboxed code meets it, the
cgroups of the calls as the host sees them, the refusal to start where no cgroup can be made, and sandboxes started
ahead of the calls, each for one call. Needs bubblewrap and root, as tests/integration/test_sandbox_probes.py."""

from __future__ import annotations

import os
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest
from sandbox_watch import uid_processes, wait_until_no_process

from dapo_megatron.config.tools import OPT_OUT, RLIMITS_ONLY
from dapo_megatron.tools import SandboxConfig, SandboxLimits, ToolsError
from dapo_megatron.tools.cgroups import BASE_PREFIX
from dapo_megatron.tools.sandbox import CodeSandbox
from dapo_megatron.tools.seccomp import refused_syscalls

pytestmark = pytest.mark.slow  # needs bwrap

UID = 40000 + os.getpid() % 20000 * 2  # used by nothing else: its processes are this module's sandboxes'
MACHINE = os.uname().machine


@pytest.fixture(scope="module", autouse=True)
def as_root():
    assert os.geteuid() == 0, "these tests run as root (as CI does): they count the sandbox's processes by uid " \
                              "and need a cgroup per call"


def _config(**settings) -> SandboxConfig:
    limits = SandboxLimits(**{"wall_s": 20.0, **settings.pop("limits", {})})
    return SandboxConfig(**{"uid": UID, "limits": limits, **settings})


def _syscall_probe(calls: dict[str, tuple[int, ...]]) -> str:
    """Code that makes each syscall by number with the given arguments and prints its name and ok or the errno."""
    numbers = {name: (refused_syscalls(MACHINE)[name], args) for name, args in calls.items()}
    return ("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
            f"for name, (number, args) in {numbers!r}.items():\n"
            "    result = libc.syscall(number, *[ctypes.c_long(a) for a in args])\n"
            "    print(name, 'ok' if result >= 0 else errno.errorcode[ctypes.get_errno()])\n")


def test_the_filter_refuses_what_model_code_has_no_use_for():
    sandbox = CodeSandbox(_config(warm=0))
    try:
        # Every refused syscall, called with zero arguments: the filter answers before the kernel looks at them.
        result = sandbox.run(_syscall_probe({name: (0,) * 6 for name in refused_syscalls(MACHINE)}))
        clone3 = sandbox.run("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                             "print(libc.syscall(435, 0, 0), errno.errorcode[ctypes.get_errno()])\n"
                             "print(libc.unshare(0x10000000), errno.errorcode[ctypes.get_errno()])\n")
    finally:
        sandbox.close()
    assert result.ok, result
    lines = dict(line.split() for line in result.text.splitlines())
    assert lines == {name: "EPERM" for name in refused_syscalls(MACHINE)}
    assert clone3.text.splitlines() == ["-1 ENOSYS", "-1 EPERM"], clone3  # glibc then falls back to clone(2)
    # Control: without the filter the same calls reach the kernel (only harmless ones: read the session keyring's
    # id, ask the personality, unshare nothing).
    unfiltered = CodeSandbox(_config(isolation=OPT_OUT))
    try:
        control = unfiltered.run(_syscall_probe({"keyctl": (0, -3), "personality": (0xFFFFFFFF,), "unshare": (0,)}))
    finally:
        unfiltered.close()
    assert control.text.split() == ["keyctl", "ok", "personality", "ok", "unshare", "ok"], control


def test_ordinary_python_runs_under_the_filter():
    import numpy as np

    site = sysconfig.get_paths()["purelib"]  # the venv's numpy, built for this Python version
    code = (f"import sys; sys.path.insert(0, {site!r})\n"
            "import math, multiprocessing, os, subprocess, threading\nimport numpy as np\n"
            "a = np.arange(40000, dtype=float).reshape(200, 200) / 1e4\n"
            "print(round(float(np.linalg.eigvalsh(a + a.T).max()), 3), math.comb(30, 15))\n"
            "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
            "print(subprocess.run([sys.executable, '-c', 'print(2 ** 10)'], capture_output=True, text=True)"
            ".stdout.strip())\n"
            "pid = os.fork()\nif pid == 0:\n    os._exit(7)\n"
            "print('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
            "with multiprocessing.Pool(2) as pool:\n    print(pool.map(math.factorial, [5, 6]))\n")
    sandbox = CodeSandbox(_config(warm=0, ro_paths=[site]))
    try:
        result = sandbox.run(code)
    finally:
        sandbox.close()
    assert result.ok, result
    a = np.arange(40000, dtype=float).reshape(200, 200) / 1e4
    lines = result.text.splitlines()
    assert lines[0] == f"{round(float(np.linalg.eigvalsh(a + a.T).max()), 3)} 155117520"
    assert lines[1:] == ["thread", "1024", "fork 7", "[120, 720]"]


def _own_memory_cgroup() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory", path.lstrip("/"))
    raise AssertionError("these tests expect the cgroup v1 memory hierarchy of the CI machine")


def test_each_call_gets_a_cgroup_and_none_is_left_behind():
    parent = _own_memory_cgroup()
    stale = parent / f"{BASE_PREFIX}{2**22 + 7}-0badc0de"  # a trainer killed before it could clean up (no such pid)
    (stale / "call-3").mkdir(parents=True)
    sandbox = CodeSandbox(_config(warm=1, limits={"memory_mb": 300}))
    try:
        assert not stale.exists(), "the cgroups of a trainer that is gone are removed at the next start"
        ours = [p for p in parent.iterdir() if p.name.startswith(f"{BASE_PREFIX}{os.getpid()}-")]
        assert len(ours) == 1
        result = sandbox.run("print(open('/proc/self/cgroup').read())")
        calls = sorted(p.name for p in ours[0].iterdir() if p.name.startswith("call-"))
        limit = int((ours[0] / calls[-1] / "memory.limit_in_bytes").read_text())
    finally:
        sandbox.close()
    assert result.ok and "memory:/\n" in result.text  # its own cgroup namespace: it sees its cgroup as the root
    assert len(calls) == 1, "the calls that ran are gone, the one started ahead is waiting"
    assert limit == 300 << 20
    assert not ours[0].exists()


def test_without_a_cgroup_the_sandbox_refuses_unless_rlimits_only_is_named():
    """The decision where the trainer may not make cgroups (not root, nothing delegated), taken for real: a child
    of this test drops to an unprivileged uid and builds the sandbox, as docs/tools-sandbox.md says it behaves."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(UID)
            os.setuid(UID)
            lines = []
            try:
                CodeSandbox(SandboxConfig())
                lines.append("started")
            except ToolsError as error:
                lines.append(str(error))
            weaker = CodeSandbox(SandboxConfig(cgroup=RLIMITS_ONLY, warm=0))
            lines.append(weaker.run("import os\nprint(os.getuid())").text.strip())
            weaker.close()
            os.write(write_end, "\n".join(lines).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    output = b""
    while chunk := os.read(read_end, 65536):
        output += chunk
    os.close(read_end)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, output
    refusal, weaker_call = output.decode().splitlines()
    assert refusal.startswith("rollout.tools.sandbox.cgroup=per_call: no cgroup can be made for the calls: "
                              "cannot make a cgroup under "), refusal
    assert "Permission denied" in refusal and f"rollout.tools.sandbox.cgroup={RLIMITS_ONLY}" in refusal
    assert weaker_call == str(UID)  # the named weaker mode runs, as the user it is


AGE = ("import os, time\nticks = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19])\n"
       "print(round(float(open('/proc/uptime').read().split()[0]) - ticks / os.sysconf('SC_CLK_TCK'), 2))\n")


def _settled_count(count, expected, timeout_s=10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (value := count()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_a_sandbox_started_ahead_runs_one_call_then_is_gone():
    ages = {}
    for warm in (2, 0):  # 0 is the control: each call starts its own sandbox when it arrives
        sandbox = CodeSandbox(_config(warm=warm))
        try:
            time.sleep(1.5 if warm else 0.0)
            waiting = uid_processes(UID)  # bwrap, the sandbox's init and the interpreter, per sandbox
            first = sandbox.run("open('/tmp/left', 'w').write('x')\nleft = 1\n" + AGE)
            second = sandbox.run("import os\nprint(os.path.exists('/tmp/left'), 'left' in globals())\n")
            after = _settled_count(lambda: uid_processes(UID), 3 * warm)
        finally:
            sandbox.close()
        assert first.ok and second.ok, (first, second)
        assert second.text == "False False\n"  # a fresh sandbox and interpreter per call
        ages[warm] = float(first.text)
        assert (waiting, after) == (3 * warm, 3 * warm), "the used sandboxes are gone, new ones wait"
        assert wait_until_no_process(UID) == 0
    # Started ahead: its interpreter was up before the call came; the control's starts with the call.
    assert ages[2] > 1.0 > ages[0], ages


def test_a_read_only_path_under_tmp_is_seen_and_stays_read_only():
    """``sandbox.ro_paths`` are bound after the sandbox's own /tmp (a venv or a data folder under /tmp, as in a CI
    checkout there, was hidden by it). Control: without the setting the folder is not there."""
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        os.chmod(folder, 0o755)  # the sandbox's uid reads it, as it reads a venv
        _check_read_only_path(Path(folder))


def _check_read_only_path(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("seen\n")
    code = (f"print(open({str(tmp_path / 'data.txt')!r}).read().strip())\n"
            f"open({str(tmp_path / 'written.txt')!r}, 'w').write('x')\n")
    results = {}
    for ro_paths in ([str(tmp_path)], []):
        sandbox = CodeSandbox(_config(warm=0, ro_paths=ro_paths))
        try:
            results[bool(ro_paths)] = sandbox.run(code)
        finally:
            sandbox.close()
    bound, control = results[True], results[False]
    assert bound.text.startswith("seen\n") and "Read-only file system" in bound.text, bound
    assert not (tmp_path / "written.txt").exists()
    assert "No such file or directory" in control.text and not control.text.startswith("seen"), control
