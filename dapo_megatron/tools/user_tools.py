"""Your own tools (``rollout.tools.functions``): ``function: "path/to/file.py:name"`` (or ``package.module:name``),

    def name(text: str, metadata: dict) -> str

``text`` is what the model passed to the tool (its one argument, ``text`` in the tool's schema, whose description is
``rollout.tools.functions[i].description``), ``metadata`` the sample's (its data source, row index, extra info and
the turn: whatever the rollout loop hands over; JSON values only); the answer is what the model reads next.

Each call runs in a fresh process (:mod:`.user_worker`) that imports your file, calls the function once and exits;
past the tool's ``timeout_s`` it is killed. So a hanging or crashing tool costs its own call and nothing else, and
no state carries from one call to the next (a module-level cache does not help; an import is paid on every call).
Your tool is trusted code like a reward function: it runs as the trainer's user with its environment, outside the
code sandbox. The function is imported once in the trainer when the pool starts, so a missing file, a failing import
or a signature that does not take ``(text, metadata)`` stops the start, naming the key.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Mapping

from dapo_megatron.reward.function import RewardFunctionError, load_reward_function
from dapo_megatron.config.tools import (PREFIX, TEXT_ARGUMENT, FunctionToolConfig, ToolsError, function_tool_schema,
                                        tool_name)
from dapo_megatron.tools.process import run_process
from dapo_megatron.tools.result import ToolResult, failure

# The worker imports this same dapo_megatron, wherever the trainer found it.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class FunctionTool:
    """One of your tools, as the :class:`~dapo_megatron.tools.tool.Tool` protocol has it."""

    def __init__(self, config: FunctionToolConfig, index: int):
        self.config = config
        self.name = tool_name(config)
        self.key = f"{PREFIX}.functions[{index}].function"
        # A relative file path is read from where the trainer started; the worker gets it absolute.
        location, _, function_name = config.function.rpartition(":")
        if location.endswith(".py") or "/" in location:
            location = str(Path(location).resolve())
        self.target = f"{location}:{function_name}"
        try:
            function = load_reward_function(self.target)
        except RewardFunctionError as error:
            raise ToolsError(f"{self.key}: {error}") from None
        if inspect.iscoroutinefunction(function):
            raise ToolsError(f"{self.key}: {config.function!r} is an async def; a tool is a plain function")
        try:
            inspect.signature(function).bind("text", {})
        except (TypeError, ValueError) as error:
            raise ToolsError(f"{self.key}: {config.function!r} must take (text: str, metadata: dict): {error}"
                             ) from None
        self._env = {**os.environ,
                     "PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}

    @property
    def schema(self) -> dict:
        return function_tool_schema(self.config)

    def call(self, arguments: Mapping[str, object], metadata: dict) -> ToolResult:
        return self.run(str(arguments[TEXT_ARGUMENT]), metadata)

    def cleanup(self) -> None:
        """Nothing outlives a call: each runs in a process of its own."""

    def run(self, text: str, metadata: dict) -> ToolResult:
        try:
            request = json.dumps({"text": text, "metadata": metadata}).encode()
        except (TypeError, ValueError) as error:
            return failure(self.name, "refused", f"[the tool call cannot be sent: metadata is not JSON: {error}]",
                           0.0)
        limit = self.config.output_bytes
        argv = [sys.executable, "-m", "dapo_megatron.tools.user_worker", self.target, str(limit)]
        # Room for JSON escapes (\uXXXX: 6 bytes a character at worst) around an answer of `limit` bytes.
        result = run_process(self.name, argv, stdin=request, env=self._env, wall_s=self.config.timeout_s,
                             output_bytes=6 * limit + 1024, stderr_to_output=False)
        if not result.ok:
            if result.kind == "timeout":
                return failure(self.name, "timeout", f"[timeout: no answer from {self.name} within "
                               f"{self.config.timeout_s:g} s; killed]", result.wall_s)
            return failure(self.name, result.kind, f"[{self.name} failed: {result.text.strip()}]", result.wall_s,
                           result.exit_code)
        try:
            reply = json.loads(result.text)
            ok = reply["ok"]
        except (ValueError, KeyError, TypeError):
            return failure(self.name, "crashed", f"[{self.name}'s process answered something unreadable: "
                           f"{result.text[:200]!r}]", result.wall_s)
        if not ok:
            return failure(self.name, "error", f"[{self.name} failed: {reply.get('error')}]", result.wall_s)
        if reply.get("truncated"):
            return failure(self.name, "output_limit", f"{reply['text']}\n[output limit: the answer was longer "
                           f"than {limit} bytes; cut]", result.wall_s)
        return ToolResult(self.name, reply["text"], True, None, result.wall_s, 0)
