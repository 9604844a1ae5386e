"""rollout.tools settings: defaults, the dotted key of each bad value, and the refusal to run model-written code
without isolation unless the opt-out is named."""

import pytest

from dapo_megatron.config import ConfigError
from dapo_megatron.tools import FunctionToolConfig, SandboxConfig, ToolPool, ToolsConfig, ToolsError
from dapo_megatron.config.tools import OPT_OUT
from dapo_megatron.tools.result import KINDS, ToolCounts, ToolResult, failure
from dapo_megatron.user_errors import EXIT_CODES


def test_defaults_validate():
    config = ToolsConfig().validate()
    assert config.sandbox.isolation == "bubblewrap"
    assert (config.sandbox.cgroup, config.sandbox.cgroup_parent, config.sandbox.warm) == ("per_call", None, 4)
    assert config.code_tool_name == "python" and config.functions == []


@pytest.mark.parametrize("change, key", [
    (lambda c: setattr(c, "pool_size", 0), "rollout.tools.pool_size"),
    (lambda c: setattr(c.sandbox.limits, "wall_s", -1.0), "rollout.tools.sandbox.limits.wall_s"),
    (lambda c: setattr(c.sandbox.limits, "memory_mb", float("nan")), "rollout.tools.sandbox.limits.memory_mb"),
    (lambda c: setattr(c.sandbox.limits, "output_bytes", True), "rollout.tools.sandbox.limits.output_bytes"),
    (lambda c: setattr(c.sandbox.limits, "processes", 1), "rollout.tools.sandbox.limits.processes"),
    (lambda c: setattr(c.sandbox, "uid", 0), "rollout.tools.sandbox.uid"),
    (lambda c: setattr(c.sandbox, "cgroup", "none"), "rollout.tools.sandbox.cgroup"),
    (lambda c: setattr(c.sandbox, "cgroup_parent", "sandbox"), "rollout.tools.sandbox.cgroup_parent"),
    (lambda c: setattr(c.sandbox, "warm", -1), "rollout.tools.sandbox.warm"),
    (lambda c: setattr(c.sandbox, "warm", 1.5), "rollout.tools.sandbox.warm"),
    (lambda c: setattr(c.sandbox, "isolation", "remote"), "rollout.tools.sandbox.remote_url"),
    (lambda c: setattr(c.sandbox, "ro_paths", ["/opt/ok", "relative/venv"]), "rollout.tools.sandbox.ro_paths[1]"),
    (lambda c: setattr(c, "code_tool_name", "run code"), "rollout.tools.code_tool_name"),
    (lambda c: c.functions.append(FunctionToolConfig(function="tools.py")), "rollout.tools.functions[0].function"),
    (lambda c: c.functions.append(FunctionToolConfig(function="tools.py:f", timeout_s=0)),
     "rollout.tools.functions[0].timeout_s"),
    (lambda c: c.functions.append(FunctionToolConfig(function="tools.py:python")), "rollout.tools.functions[0].name"),
    (lambda c: c.functions.extend([FunctionToolConfig(function="a.py:f"), FunctionToolConfig(function="b.py:f")]),
     "rollout.tools.functions[1].name"),
    (lambda c: c.functions.append(FunctionToolConfig(function="a.py:f", name="failed")),
     "rollout.tools.functions[0].name"),
])
def test_bad_values_name_their_key(change, key):
    config = ToolsConfig()
    change(config)
    with pytest.raises(ConfigError) as error:
        config.validate()
    assert str(error.value).startswith(f"{key}:")


def test_remote_with_a_url_validates():
    ToolsConfig(sandbox=SandboxConfig(isolation="remote", remote_url="http://127.0.0.1:8080")).validate()


def test_missing_bwrap_refuses_and_names_the_opt_out(tmp_path):
    missing = str(tmp_path / "no" / "bwrap")
    config = ToolsConfig(enabled=True, sandbox=SandboxConfig(bwrap=missing))
    with pytest.raises(ToolsError) as error:
        ToolPool(config)
    message = str(error.value)
    assert message.startswith("rollout.tools.sandbox.bwrap: bubblewrap not found at")
    assert missing in message and f"rollout.tools.sandbox.isolation={OPT_OUT}" in message
    assert "\n" not in message
    assert isinstance(error.value, ConfigError) and error.value.exit_code == EXIT_CODES["config"]
    # Control: the same setting with the opt-out named starts and runs code (without isolation).
    config.sandbox.isolation = OPT_OUT
    pool = ToolPool(config)
    try:
        result = pool.call("python", "print(6 * 7)")
    finally:
        pool.close()
    assert result.ok and result.text == "42\n"


def test_python_outside_usr_and_ro_paths_is_refused(tmp_path):
    python = str(tmp_path / "venv" / "bin" / "python")
    config = ToolsConfig(sandbox=SandboxConfig(python=python))
    with pytest.raises(ToolsError, match=r"^rollout\.tools\.sandbox\.python: .* add its installation folder"):
        ToolPool(config)


def _write_tools(path):
    path.write_text("def two(text, metadata):\n    return text\n"
                    "def one(text):\n    return text\n"
                    "async def later(text, metadata):\n    return text\n")
    return path


@pytest.mark.parametrize("name, message", [
    ("one", "must take (text: str, metadata: dict)"),
    ("later", "is an async def"),
    ("absent", "has no 'absent'"),
])
def test_a_tool_that_cannot_be_called_so_stops_the_start(tmp_path, name, message):
    tools = _write_tools(tmp_path / "tools.py")
    config = ToolsConfig(code=False, functions=[FunctionToolConfig(function="ok.py:x"),
                                                FunctionToolConfig(function=f"{tools}:{name}")])
    config.functions[0].function = f"{tools}:two"  # the first is fine: the error names the second
    with pytest.raises(ToolsError) as error:
        ToolPool(config)
    assert str(error.value).startswith("rollout.tools.functions[1].function:")
    assert message in str(error.value)


def test_a_missing_tool_file_is_named(tmp_path):
    config = ToolsConfig(code=False, functions=[FunctionToolConfig(function=f"{tmp_path}/none.py:f")])
    with pytest.raises(ToolsError, match=r"^rollout\.tools\.functions\[0\]\.function: .*no such file"):
        ToolPool(config)


def test_counts_add_up_per_kind_and_tool():
    counts = ToolCounts(["python", "search"])
    counts.add(ToolResult("python", "4\n", True, None, 0.5, 0))
    counts.add(failure("python", "timeout", "[timeout]", 2.0))
    counts.add(failure("search", "error", "[error]", 0.25))
    snapshot = counts.snapshot()
    assert snapshot["tools/calls"] == 3 and snapshot["tools/failed"] == 2
    assert snapshot["tools/failed/timeout"] == 1 and snapshot["tools/failed/error"] == 1
    assert snapshot["tools/python/calls"] == 2 and snapshot["tools/python/failed"] == 1
    assert snapshot["tools/search/failed"] == 1 and snapshot["tools/wall_s"] == 2.75
    assert {k for k in snapshot if k.startswith("tools/failed/")} == {f"tools/failed/{k}" for k in KINDS}
    with pytest.raises(ValueError, match="unknown tool failure kind"):
        failure("python", "oops", "", 0.0)


def test_unknown_tool_and_closed_pool_are_refused_and_counted():
    pool = ToolPool(ToolsConfig(sandbox=SandboxConfig(isolation=OPT_OUT)))
    unknown = pool.call("search", "x")
    pool.close()
    closed = pool.call("python", "print(1)")
    assert (unknown.ok, unknown.kind) == (False, "refused") and "the tools are: python" in unknown.text
    assert (closed.ok, closed.kind) == (False, "refused")
    assert pool.counts()["tools/failed/refused"] == 2
