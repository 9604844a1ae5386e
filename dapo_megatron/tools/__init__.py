"""Tools a model can call during a rollout (tool-integrated reasoning): a Python code sandbox and your own
functions, behind one bounded pool (:class:`ToolPool`). Settings: ``rollout.tools``
(:mod:`dapo_megatron.config.tools`); isolation and limits: docs/tools-sandbox.md."""

from dapo_megatron.config.tools import FunctionToolConfig, SandboxConfig, SandboxLimits, ToolsConfig, ToolsError
from dapo_megatron.tools.pool import ToolPool
from dapo_megatron.tools.result import KINDS, ToolResult

__all__ = ["FunctionToolConfig", "KINDS", "SandboxConfig", "SandboxLimits", "ToolPool", "ToolResult",
           "ToolsConfig", "ToolsError"]
