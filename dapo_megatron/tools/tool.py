"""What every tool is to the pool and the rollout loop: a :class:`Tool`.

    tool.name                          # what the model calls it
    tool.schema                        # an OpenAI function schema: what the model is told it takes
    tool.call(arguments, metadata)     # a ToolResult; never an exception for what the call did
    tool.cleanup()                     # releases what the tool holds (a connection, started sandboxes)

The built-in python tool (:class:`~dapo_megatron.tools.sandbox.CodeSandbox`, or
:class:`~dapo_megatron.tools.remote.SandboxFusionClient` under ``isolation: remote``) and your function tools
(:class:`~dapo_megatron.tools.user_tools.FunctionTool`) implement it; the pool (:mod:`.pool`) calls nothing else.

``arguments`` is the JSON object of the call (what a call format read from the model's text,
:mod:`.call_formats`), checked against the schema before the tool sees it (:func:`arguments_problem`); the tools
here take one string argument each, which :func:`text_argument` names.
"""

from __future__ import annotations

import abc
from typing import Mapping, Protocol, runtime_checkable

from dapo_megatron.config.tools import CODE_ARGUMENT, code_tool_schema
from dapo_megatron.tools.result import ToolResult


@runtime_checkable
class Tool(Protocol):
    name: str

    @property
    def schema(self) -> dict: ...

    def call(self, arguments: Mapping[str, object], metadata: dict) -> ToolResult: ...

    def cleanup(self) -> None: ...


class CodeRunner(abc.ABC):
    """The python tool over a way to run a program: ``run(code)`` is the backend's (the bubblewrap sandbox, the
    SandboxFusion service); the rest of the :class:`Tool` protocol is the same for every backend. ``self.tool`` is
    the tool's name."""

    tool: str

    @abc.abstractmethod
    def run(self, code: str) -> ToolResult:
        """Run ``code`` (a whole Python program)."""

    @property
    def name(self) -> str:
        return self.tool

    @property
    def schema(self) -> dict:
        return code_tool_schema(self.tool)

    def call(self, arguments: Mapping[str, object], metadata: dict) -> ToolResult:  # noqa: ARG002 - the code alone
        return self.run(str(arguments[CODE_ARGUMENT]))

    def cleanup(self) -> None:
        """Nothing is held between calls by default."""


def text_argument(schema: dict) -> str | None:
    """The one required string argument of a tool's schema (what a call format that writes plain text passes);
    None when the schema has another shape."""
    parameters = schema.get("parameters", {})
    required = parameters.get("required", [])
    properties = parameters.get("properties", {})
    if len(required) == 1 and len(properties) == 1 and properties.get(required[0], {}).get("type") == "string":
        return required[0]
    return None


def arguments_problem(schema: dict, arguments: object) -> str | None:
    """What is wrong with ``arguments`` for a tool of ``schema`` (flat objects of string, number, boolean values, as
    the tools here take), or None. Model-written: anything may arrive."""
    if not isinstance(arguments, Mapping):
        return f"the arguments must be a JSON object, got {type(arguments).__name__}"
    parameters = schema.get("parameters", {})
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(map(repr, missing))}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        return f"unknown argument(s) {', '.join(map(repr, unknown))}; {schema['name']} takes {', '.join(properties)}"
    for name, value in arguments.items():
        wanted = properties[name].get("type")
        if wanted == "string" and not isinstance(value, str):
            return f"argument {name!r} must be a string, got {type(value).__name__}"
    return None
