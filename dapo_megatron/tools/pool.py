"""The tools a rollout can call, behind one bounded pool: what the multi-turn rollout loop talks to. A run builds one
(with its rollout generator, :func:`dapo_megatron.rollout.factory.build_rollout_generator`), which training and
validation share.

    pool = ToolPool(config.rollout.tools)              # checks the sandbox and imports your tools, or refuses to start
    future = pool.submit("python", code, metadata)     # at most pool_size calls run at once, the rest wait
    future = pool.submit("python", {"code": code})     # the same call as a JSON call format reads it
    result = future.result()                           # a ToolResult; never an exception for what the call did
    pool.counts()                                      # tools/calls, tools/failed, tools/failed/<kind>, ...
    pool.close()

Every tool is a :class:`~dapo_megatron.tools.tool.Tool` (name, schema, call, cleanup): the python tool (the sandbox
or the SandboxFusion client, per ``sandbox.isolation``) and your functions. Every call is its own process or HTTP
request, driven by one of ``pool_size`` threads; the wall time of each is bounded by its own limit, so a call ends
within its limit plus the time it waited for a thread. Arguments are checked against the tool's schema before it
runs: what the model wrote may be anything.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping

from dapo_megatron.config.tools import ToolsConfig
from dapo_megatron.tools.remote import SandboxFusionClient
from dapo_megatron.tools.result import ToolCounts, ToolResult, failure
from dapo_megatron.tools.sandbox import CodeSandbox
from dapo_megatron.tools.tool import Tool, arguments_problem, text_argument
from dapo_megatron.tools.user_tools import FunctionTool


def build_tools(config: ToolsConfig) -> list[Tool]:
    """The tools ``config`` offers, the python tool first; each checks itself as it is built (the sandbox's test
    call, your function's import) and raises :class:`~dapo_megatron.config.tools.ToolsError` naming the key."""
    tools: list[Tool] = []
    if config.code:
        runner = SandboxFusionClient if config.sandbox.isolation == "remote" else CodeSandbox
        tools.append(runner(config.sandbox, config.code_tool_name))
    tools += [FunctionTool(tool, index) for index, tool in enumerate(config.functions)]
    return tools


class ToolPool:
    """The tools of ``config`` (:func:`build_tools`), ``config.pool_size`` calls at a time."""

    def __init__(self, config: ToolsConfig):
        config.validate()
        self.config = config
        self._tools: dict[str, Tool] = {tool.name: tool for tool in build_tools(config)}
        self._counts = ToolCounts(list(self._tools))
        self._lock = threading.Lock()
        self._closed = False
        self._threads = ThreadPoolExecutor(max_workers=config.pool_size, thread_name_prefix="dapo-tool")

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    @property
    def schemas(self) -> list[dict]:
        return [tool.schema for tool in self._tools.values()]

    def submit(self, name: str, arguments: str | Mapping[str, object], metadata: dict | None = None) -> Future:
        """Start a call of tool ``name``; the future's result is its :class:`ToolResult`. ``arguments``: the call's
        JSON object, or a text for the tool's one text argument (what the fenced call format passes)."""
        with self._lock:
            if not self._closed:
                return self._threads.submit(self._call, name, arguments, dict(metadata or {}))
        return self.refuse(name, "[the tool pool is closed]")

    def refuse(self, name: str, text: str) -> Future:
        """A call that does not run (the model wrote one the call format cannot read), answered and counted as
        ``refused`` at once."""
        future: Future = Future()
        future.set_result(self._count(failure(name, "refused", text, 0.0)))
        return future

    def call(self, name: str, arguments: str | Mapping[str, object], metadata: dict | None = None) -> ToolResult:
        return self.submit(name, arguments, metadata).result()

    def counts(self) -> dict[str, float]:
        """Totals since the start (:func:`dapo_megatron.tools.result.tool_counts`)."""
        return self._counts.snapshot()

    def _call(self, name: str, arguments: str | Mapping[str, object], metadata: dict) -> ToolResult:
        start = time.monotonic()
        tool = self._tools.get(name)
        if tool is None:
            return self._count(failure(name, "refused", f"[no tool named {name!r}; the tools are: "
                                                        f"{', '.join(self._tools)}]", 0.0))
        schema = tool.schema
        if isinstance(arguments, str):
            argument = text_argument(schema)
            if argument is None:
                return self._count(failure(name, "refused", f"[{name} takes {schema['parameters']}, not a text]", 0.0))
            arguments = {argument: arguments}
        problem = arguments_problem(schema, arguments)
        if problem is not None:
            return self._count(failure(name, "refused", f"[{name} was not called: {problem}]", 0.0))
        try:
            result = tool.call(arguments, metadata)
        except Exception as error:  # a bug of ours must not end the rollout either: the call fails, counted
            result = failure(name, "crashed", f"[the tool call failed: {type(error).__name__}: {error}]",
                             time.monotonic() - start)
        return self._count(result)

    def _count(self, result: ToolResult) -> ToolResult:
        self._counts.add(result)
        return result

    def close(self) -> None:
        """Wait for the calls in flight (each ends within its limit), then let every tool release what it holds."""
        with self._lock:
            self._closed = True
        self._threads.shutdown(wait=True)
        for tool in self._tools.values():
            tool.cleanup()
