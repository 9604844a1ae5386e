"""``isolation: remote``: the python tool runs on a SandboxFusion service, through its ``run_code`` API.

One POST per call to ``{remote_url}/run_code`` with ``{"code", "language": "python", "run_timeout",
"memory_limit_MB"}`` (the sandbox's ``wall_s`` and ``memory_mb``); the reply is read as SandboxFusion defines it:
``status`` ("Success" | "Failed" | "SandboxError"), ``message``, and ``run_result`` with ``status`` ("Finished" |
"Error" | "TimeLimitExceeded"), ``return_code``, ``stdout``, ``stderr``. The model reads stdout then stderr, cut at
``output_bytes``. The service's own isolation and limits apply; this side bounds the wait (``run_timeout`` plus
``REPLY_MARGIN_S``) and a refused connection fails the call at once (no retry: the rollout goes on without it).
"""

from __future__ import annotations

import time

import requests

from dapo_megatron.config.tools import SandboxConfig
from dapo_megatron.tools.process import last_line
from dapo_megatron.tools.result import ToolResult, failure
from dapo_megatron.tools.tool import CodeRunner

REPLY_MARGIN_S = 10.0  # the service's queueing and start-up on top of the code's own run time


class MalformedReply(ValueError):
    """The reply is not what SandboxFusion's run_code answers; the message names the field."""


class SandboxFusionClient(CodeRunner):
    """The python tool on a SandboxFusion service (the :class:`~dapo_megatron.tools.tool.Tool` protocol through
    :class:`CodeRunner`); its HTTP session is released by :meth:`cleanup`."""

    def __init__(self, sandbox: SandboxConfig, tool: str = "python"):
        self.url = sandbox.remote_url.rstrip("/") + "/run_code"
        self.tool = tool
        self.limits = sandbox.limits
        self.connect_timeout_s = sandbox.remote_connect_timeout_s
        self._session = requests.Session()

    def run(self, code: str) -> ToolResult:
        start = time.monotonic()
        body = {"code": code, "language": "python", "run_timeout": self.limits.wall_s,
                "memory_limit_MB": self.limits.memory_mb}
        try:
            response = self._session.post(self.url, json=body,
                                          timeout=(self.connect_timeout_s, self.limits.wall_s + REPLY_MARGIN_S))
        except requests.ConnectionError as error:
            return failure(self.tool, "refused", f"[the code sandbox service at {self.url} is unreachable: "
                           f"{_reason(error)}]", time.monotonic() - start)
        except requests.Timeout:
            return failure(self.tool, "timeout", f"[no reply from the code sandbox service within "
                           f"{self.limits.wall_s + REPLY_MARGIN_S:g} s]", time.monotonic() - start)
        except requests.RequestException as error:
            return failure(self.tool, "crashed", f"[the code sandbox request failed: {error}]",
                           time.monotonic() - start)
        wall = time.monotonic() - start
        if response.status_code != 200:
            return failure(self.tool, "crashed", f"[the code sandbox service answered HTTP {response.status_code}: "
                           f"{response.text[:200]}]", wall)
        try:
            return self._read(response, wall)
        except MalformedReply as error:
            return failure(self.tool, "crashed", f"[the code sandbox service's reply is malformed: {error}]", wall)

    def _read(self, response: requests.Response, wall: float) -> ToolResult:
        try:
            reply = response.json()
        except ValueError:
            raise MalformedReply(f"not JSON: {response.text[:200]!r}") from None
        if not isinstance(reply, dict):
            raise MalformedReply(f"not a JSON object: {reply!r:.200}")
        status = _field(reply, "status", str, "status")
        if status == "SandboxError":
            message = reply.get("message") or ""
            return failure(self.tool, "crashed", f"[the code sandbox service failed: {message}]", wall)
        if status not in ("Success", "Failed"):
            raise MalformedReply(f"'status' is {status!r}, not Success, Failed or SandboxError")
        run = _field(reply, "run_result", dict, "run_result")
        run_status = _field(run, "status", str, "run_result.status")
        stdout = _field(run, "stdout", (str, type(None)), "run_result.stdout") or ""
        stderr = _field(run, "stderr", (str, type(None)), "run_result.stderr") or ""
        code = _field(run, "return_code", (int, type(None)), "run_result.return_code")
        data = (stdout + stderr).encode("utf-8", errors="replace")
        cap = self.limits.output_bytes
        text = data[:cap].decode("utf-8", errors="replace")
        if run_status == "TimeLimitExceeded":
            return failure(self.tool, "timeout", f"{text}\n[timeout: still running after {self.limits.wall_s:g} s]",
                           wall, code)
        if run_status == "Error":
            return failure(self.tool, "crashed", f"{text}\n[the code sandbox service could not run it]", wall, code)
        if run_status != "Finished":
            raise MalformedReply(f"'run_result.status' is {run_status!r}, not Finished, Error or TimeLimitExceeded")
        if len(data) > cap:
            return failure(self.tool, "output_limit", f"{text}\n[output limit: more than {cap} bytes of output; "
                           "cut]", wall, code)
        if status == "Success" and code in (0, None):
            return ToolResult(self.tool, text, True, None, wall, code)
        if last_line(stderr).startswith("MemoryError"):
            return failure(self.tool, "memory", f"{text}\n[memory limit: an allocation failed]", wall, code)
        return failure(self.tool, "error", f"{text}\n[exit status {code}]", wall, code)

    def cleanup(self) -> None:
        self._session.close()


def _field(mapping: dict, name: str, kind, dotted: str):
    if name not in mapping:
        raise MalformedReply(f"no {dotted!r}")
    value = mapping[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise MalformedReply(f"{dotted!r} is {value!r:.100}, not {_kind_name(kind)}")
    return value


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def _reason(error: requests.ConnectionError) -> str:
    cause = error.args[0] if error.args else error
    reason = getattr(cause, "reason", cause)
    return str(reason)[:200]
