"""The settings of tool calls in rollouts (``rollout.tools``): the code sandbox and your own tools.

Defaults are the limits one short Python computation needs (a math check, a small search); docs/tools-sandbox.md says
what each limit does and how it is enforced. ``validate()`` names the dotted key of the first bad value.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Literal

from dapo_megatron.config.errors import ConfigError

# "none_i_accept_the_risk" is spelled out so that running model-written code without isolation is a decision
# someone typed, never a default or a typo.
Isolation = Literal["bubblewrap", "none_i_accept_the_risk", "remote"]
OPT_OUT = "none_i_accept_the_risk"
# Where a call's limits hold: "per_call", a cgroup per call (memory with shared memory, processes and CPU time of
# all its processes together), or "rlimits_only", the weaker mode a user names where no cgroup can be made: each
# process is bounded on its own (address space, CPU time), processes per call by RLIMIT_NPROC.
CallLimits = Literal["per_call", "rlimits_only"]
RLIMITS_ONLY = "rlimits_only"
PREFIX = "rollout.tools"
RESERVED_NAMES = ("calls", "failed", "wall_s")  # the metric names tools/<name>/... would collide with


@dataclass
class SandboxLimits:
    """Per call. ``wall_s`` is enforced by the trainer (it kills the call's processes); ``cpu_s``, ``memory_mb``
    and ``processes`` hold for the call's processes together (its cgroup) and for each process (rlimits, the second
    line; the only one under ``cgroup: rlimits_only``); ``workdir_mb`` is the size of its private tmpfs."""

    wall_s: float = 10.0  # from start to the last byte of output
    cpu_s: int = 10  # the call's CPU time (cgroup, read by the trainer); each process's RLIMIT_CPU (SIGXCPU)
    memory_mb: int = 1024  # the call's memory, shared memory and tmpfs (cgroup); each process's RLIMIT_AS
    processes: int = 32  # processes and threads: pids.max of the call; RLIMIT_NPROC in its user namespace
    open_files: int = 64  # RLIMIT_NOFILE
    file_mb: int = 16  # RLIMIT_FSIZE: the largest file it may write
    workdir_mb: int = 64  # size of its working folder (and of its /tmp), both tmpfs, gone after the call
    output_bytes: int = 16384  # stdout+stderr kept; past it the call is killed and counted as output_limit


@dataclass
class SandboxConfig:
    """The built-in ``python`` tool: runs a Python code block, answers with its stdout+stderr."""

    isolation: Isolation = "bubblewrap"
    bwrap: str = "bwrap"  # the bubblewrap executable: a name on PATH or a path
    python: str = "/usr/bin/python3"  # the sandbox's interpreter; it must lie under /usr or one of ro_paths
    ro_paths: list[str] = field(default_factory=list)  # more folders shown read-only (a venv with sympy, ...)
    # When the trainer runs as root the sandbox runs as this uid instead: RLIMIT_NPROC does not apply to root.
    uid: int = 65534
    cgroup: CallLimits = "per_call"  # per_call refuses to start where no cgroup can be made (docs/tools-sandbox.md)
    cgroup_parent: str | None = None  # the cgroup (as /proc/self/cgroup names it) to make the calls' cgroups in
    warm: int = 4  # sandboxes started ahead of demand, each for one call (0: each call starts its own)
    remote_url: str | None = None  # isolation=remote: a SandboxFusion service (POST {remote_url}/run_code)
    remote_connect_timeout_s: float = 5.0
    limits: SandboxLimits = field(default_factory=SandboxLimits)


@dataclass
class FunctionToolConfig:
    """One of your tools: ``function: "path/to/file.py:name"`` (or ``package.module:name``), called as
    ``name(text: str, metadata: dict) -> str`` in a process of its own, ended after ``timeout_s``."""

    function: str = ""
    name: str | None = None  # what the model calls it; default: the function's name
    timeout_s: float = 30.0
    output_bytes: int = 16384


@dataclass
class ToolsConfig:
    enabled: bool = False  # whether rollouts offer tools at all (the rollout loop's switch; ToolPool ignores it)
    code: bool = True  # offer the built-in python tool (when enabled)
    code_tool_name: str = "python"
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    functions: list[FunctionToolConfig] = field(default_factory=list)
    pool_size: int = 8  # tool calls running at once, all tools together
    # The rollout loop (dapo_megatron/rollout/multi_turn.py). A call is a fenced block whose info string names a
    # tool: call_open with {tool} replaced by its name, the text, then call_end, where generation stops.
    max_turns: int = 4  # generation turns per response; the call that ends the last one is not run
    max_tool_output_tokens: int = 512  # of each tool answer, before output_format wraps it
    call_open: str = "```{tool}\n"
    # "\n```\n", not "\n```": a line that OPENS a fence ("\n```python") must not end the turn
    call_end: str = "\n```\n"
    output_format: str = "```output\n{output}\n```\n"  # how the answer is appended to the context

    def validate(self) -> "ToolsConfig":
        _positive(self.pool_size, "pool_size")
        for name in ("max_turns", "max_tool_output_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                _fail(name, f"must be an integer >= 1, got {getattr(self, name)!r}")
        if self.call_open.count("{tool}") != 1 or not self.call_open.split("{tool}")[0]:
            _fail("call_open", f"must hold {{tool}} once, after some text, got {self.call_open!r}")
        if not self.call_end.strip():
            _fail("call_end", f"must hold more than white space, got {self.call_end!r}")
        if self.output_format.count("{output}") != 1:
            _fail("output_format", f"must hold {{output}} once, got {self.output_format!r}")
        sandbox, limits = self.sandbox, self.sandbox.limits
        for name in ("wall_s", "cpu_s", "memory_mb", "processes", "open_files", "file_mb", "workdir_mb",
                     "output_bytes"):
            _positive(getattr(limits, name), f"sandbox.limits.{name}")
        if limits.processes < 2:
            _fail("sandbox.limits.processes", "must be at least 2 (the interpreter and the sandbox's init)")
        if sandbox.cgroup not in ("per_call", RLIMITS_ONLY):
            _fail("sandbox.cgroup", f"must be per_call or {RLIMITS_ONLY}, got {sandbox.cgroup!r}")
        if sandbox.cgroup_parent is not None and not sandbox.cgroup_parent.startswith("/"):
            _fail("sandbox.cgroup_parent", f"must be a cgroup path starting with '/' (as /proc/self/cgroup shows "
                                           f"it), got {sandbox.cgroup_parent!r}")
        if isinstance(sandbox.warm, bool) or not isinstance(sandbox.warm, int) or sandbox.warm < 0:
            _fail("sandbox.warm", f"must be an integer >= 0, got {sandbox.warm!r}")
        if not 0 < sandbox.uid < 2**32 - 1:
            _fail("sandbox.uid", f"must be a non-root uid (1 .. 4294967294), got {sandbox.uid}")
        _positive(sandbox.remote_connect_timeout_s, "sandbox.remote_connect_timeout_s")
        if sandbox.isolation == "remote":
            url = sandbox.remote_url or ""
            if not url.startswith(("http://", "https://")):
                _fail("sandbox.remote_url", f"isolation=remote needs an http(s):// URL, got {sandbox.remote_url!r}")
        if not sandbox.python:
            _fail("sandbox.python", "may not be empty")
        for i, path in enumerate(sandbox.ro_paths):
            if not os.path.isabs(path):
                _fail(f"sandbox.ro_paths[{i}]", f"must be an absolute path, got {path!r}")
        if not self.code_tool_name.isidentifier() or self.code_tool_name in RESERVED_NAMES:
            _fail("code_tool_name", f"must be an identifier other than {RESERVED_NAMES}, got {self.code_tool_name!r}")
        names = [self.code_tool_name] if self.code else []
        for i, tool in enumerate(self.functions):
            key = f"functions[{i}]"
            location, _, function = tool.function.rpartition(":")
            if not location or not function:
                _fail(f"{key}.function", f"must be 'path/to/file.py:name' or 'package.module:name', "
                                         f"got {tool.function!r}")
            _positive(tool.timeout_s, f"{key}.timeout_s")
            _positive(tool.output_bytes, f"{key}.output_bytes")
            name = tool_name(tool)
            if not name.isidentifier() or name in RESERVED_NAMES:
                _fail(f"{key}.name", f"must be an identifier other than {RESERVED_NAMES}, got {name!r}")
            if name in names:
                _fail(f"{key}.name", f"{name!r} names another tool already; give this one a name of its own")
            names.append(name)
        return self


class ToolsError(ConfigError):
    """The tools cannot start as configured (isolation unavailable, a tool that does not load); names the key."""


def tool_name(tool: FunctionToolConfig) -> str:
    """The name a function tool is called by: its ``name``, else the function's own."""
    return tool.name or tool.function.rpartition(":")[2]


def _positive(value, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        _fail(key, f"must be a positive number, got {value!r}")


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"{PREFIX}.{key}: {message}")
