"""Tools a model can call during a rollout (tool-integrated reasoning): one protocol (:class:`Tool`: name, schema,
call, cleanup) that the Python code sandbox, the SandboxFusion client and your own functions implement, one bounded
pool per run (:class:`ToolPool`), and the call formats a model writes calls in (:mod:`.call_formats`: fenced blocks,
Hermes ``<tool_call>`` JSON). Settings: ``rollout.tools`` (:mod:`dapo_megatron.config.tools`); isolation and limits:
docs/tools-sandbox.md."""

from dapo_megatron.config.tools import FunctionToolConfig, SandboxConfig, SandboxLimits, ToolsConfig, ToolsError
from dapo_megatron.tools.call_formats import CALL_FORMATS, CallFormat, ToolCall, call_format
from dapo_megatron.tools.pool import ToolPool, build_tools
from dapo_megatron.tools.result import KINDS, ToolResult, tool_counts
from dapo_megatron.tools.tool import Tool

__all__ = ["CALL_FORMATS", "CallFormat", "FunctionToolConfig", "KINDS", "SandboxConfig", "SandboxLimits", "Tool",
           "ToolCall", "ToolPool", "ToolResult", "ToolsConfig", "ToolsError", "build_tools", "call_format",
           "tool_counts"]
