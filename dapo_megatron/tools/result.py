"""What one tool call came to, and the counts of them the trainer logs.

A call never raises into the rollout: whatever happens to it is a :class:`ToolResult` whose ``text`` is what the
model reads next (the tool's answer, or what went wrong) and whose ``kind`` says how it failed:

=============== ==============================================================================================
kind            when
=============== ==============================================================================================
``timeout``     past the wall time (the trainer killed it) or the CPU time (RLIMIT_CPU); a remote time limit
``memory``      an allocation failed at the memory limit (the interpreter's ``MemoryError``)
``output_limit`` more output than the limit: the call was killed at the cap, the text is the first part
``error``       the code exited with a non-zero status (an uncaught exception); your tool raised
``killed``      ended by SIGKILL/SIGTERM/... that the trainer did not send (it killed itself, the OOM killer)
``crashed``     a fault signal (SIGSEGV, SIGABRT, ...), a sandbox or tool process that failed, a malformed
                reply of the remote service
``refused``     not run: unknown tool, arguments the tool does not take, a call the format cannot read, the
                pool closed, the remote service unreachable
=============== ==============================================================================================
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable

KINDS = ("timeout", "memory", "output_limit", "error", "killed", "crashed", "refused")


@dataclass(frozen=True)
class ToolResult:
    tool: str
    text: str  # what the model reads
    ok: bool
    kind: str | None  # one of KINDS when not ok
    wall_s: float
    exit_code: int | None = None  # the process's status (128 + signal for a signal), when there was one


def failure(tool: str, kind: str, text: str, wall_s: float, exit_code: int | None = None) -> ToolResult:
    if kind not in KINDS:
        raise ValueError(f"unknown tool failure kind {kind!r}")
    return ToolResult(tool, text, False, kind, wall_s, exit_code)


def tool_counts(results: Iterable[ToolResult], tools: Iterable[str]) -> dict[str, float]:
    """``tools/calls``, ``tools/failed``, ``tools/failed/<kind>`` and ``tools/wall_s`` of ``results``, plus
    ``tools/<name>/calls`` and ``tools/<name>/failed`` for each of ``tools`` (the pool's: a call of a name the model
    made up counts in the totals only, so what the model writes never adds a metric); every key present, 0 when
    nothing happened."""
    counts: dict[str, float] = {"tools/calls": 0, "tools/failed": 0, "tools/wall_s": 0.0}
    counts.update({f"tools/failed/{kind}": 0 for kind in KINDS})
    for tool in tools:
        counts.update({f"tools/{tool}/calls": 0, f"tools/{tool}/failed": 0})
    for result in results:
        _count(counts, result)
    return counts


def _count(counts: dict[str, float], result: ToolResult) -> None:
    for prefix in ("tools", f"tools/{result.tool}"):
        if f"{prefix}/calls" in counts:
            counts[f"{prefix}/calls"] += 1
            counts[f"{prefix}/failed"] += int(not result.ok)
    if not result.ok:
        counts[f"tools/failed/{result.kind}"] += 1
    counts["tools/wall_s"] += result.wall_s


class ToolCounts:
    """Thread-safe :func:`tool_counts` of every call since the start."""

    def __init__(self, tools: list[str]):
        self._lock = threading.Lock()
        self._counts = tool_counts([], tools)

    def add(self, result: ToolResult) -> None:
        with self._lock:
            _count(self._counts, result)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)
