"""The tools a rollout can call, behind one bounded pool: what the multi-turn rollout loop talks to.

    pool = ToolPool(config.rollout.tools)        # checks the sandbox and imports your tools, or refuses to start
    future = pool.submit("python", code, metadata)   # at most pool_size calls run at once, the rest wait
    result = future.result()                         # a ToolResult; never an exception for what the call did
    pool.counts()                                    # tools/calls, tools/failed, tools/failed/<kind>, ...
    pool.close()

Every call is its own process (a bubblewrap sandbox, a plain process under the opt-out, or your tool's worker) or
HTTP request, driven by one of ``pool_size`` threads; the wall time of each is bounded by its own limit, so a
call ends within its limit plus the time it waited for a thread.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from dapo_megatron.config.tools import ToolsConfig
from dapo_megatron.tools.remote import SandboxFusionClient
from dapo_megatron.tools.result import ToolCounts, ToolResult, failure
from dapo_megatron.tools.sandbox import CodeSandbox
from dapo_megatron.tools.user_tools import FunctionTool


class ToolPool:
    def __init__(self, config: ToolsConfig):
        config.validate()
        self.config = config
        self._tools: dict[str, object] = {}
        if config.code:
            name = config.code_tool_name
            if config.sandbox.isolation == "remote":
                self._tools[name] = SandboxFusionClient(config.sandbox, name)
            else:
                self._tools[name] = CodeSandbox(config.sandbox, name)
        for index, tool in enumerate(config.functions):
            function_tool = FunctionTool(tool, index)
            self._tools[function_tool.name] = function_tool
        self._counts = ToolCounts(list(self._tools))
        self._lock = threading.Lock()
        self._closed = False
        self._threads = ThreadPoolExecutor(max_workers=config.pool_size, thread_name_prefix="dapo-tool")

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def submit(self, name: str, text: str, metadata: dict | None = None) -> Future:
        """Start a call of tool ``name``; the future's result is its :class:`ToolResult`."""
        with self._lock:
            if not self._closed:
                return self._threads.submit(self._call, name, text, dict(metadata or {}))
        future: Future = Future()
        future.set_result(self._count(failure(name, "refused", "[the tool pool is closed]", 0.0)))
        return future

    def call(self, name: str, text: str, metadata: dict | None = None) -> ToolResult:
        return self.submit(name, text, metadata).result()

    def counts(self) -> dict[str, float]:
        """Totals since the start (see :class:`dapo_megatron.tools.result.ToolCounts`)."""
        return self._counts.snapshot()

    def _call(self, name: str, text: str, metadata: dict) -> ToolResult:
        start = time.monotonic()
        tool = self._tools.get(name)
        if tool is None:
            result = failure(name, "refused", f"[no tool named {name!r}; the tools are: {', '.join(self._tools)}]",
                             0.0)
            return self._count(result)
        try:
            result = tool.run(text, metadata) if isinstance(tool, FunctionTool) else tool.run(text)
        except Exception as error:  # a bug of ours must not end the rollout either: the call fails, counted
            result = failure(name, "crashed", f"[the tool call failed: {type(error).__name__}: {error}]",
                             time.monotonic() - start)
        return self._count(result)

    def _count(self, result: ToolResult) -> ToolResult:
        self._counts.add(result)
        return result

    def close(self) -> None:
        """Wait for the calls in flight (each ends within its limit), then release the tools."""
        with self._lock:
            self._closed = True
        self._threads.shutdown(wait=True)
        for tool in self._tools.values():
            if isinstance(tool, SandboxFusionClient):
                tool.close()
