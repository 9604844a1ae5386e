"""rollout.tools inside the run config: its loop settings and their dotted keys; tools with async rollouts."""

import pytest

from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.tools import ToolsConfig


def test_tools_are_off_by_default_and_load_from_overrides():
    config = load_config("examples/tiny_cpu.yaml")
    assert config.rollout.tools.enabled is False
    config = load_config("examples/tiny_cpu.yaml", ["rollout.tools.enabled=true", "rollout.tools.max_turns=3",
                                                    "rollout.tools.max_tool_output_tokens=64"])
    tools = config.rollout.tools
    assert (tools.enabled, tools.max_turns, tools.max_tool_output_tokens) == (True, 3, 64)
    assert tools.call_open.format(tool=tools.code_tool_name) == "```python\n" and tools.call_end == "\n```\n"


@pytest.mark.parametrize("override, key", [
    ("rollout.tools.max_turns=0", "rollout.tools.max_turns"),
    ("rollout.tools.max_tool_output_tokens=0", "rollout.tools.max_tool_output_tokens"),
    ("rollout.tools.call_open=```", "rollout.tools.call_open"),
    ("rollout.tools.output_format=out", "rollout.tools.output_format"),
    ("rollout.tools.pool_size=0", "rollout.tools.pool_size"),  # the tools' own checks run from rollout.validate
])
def test_bad_loop_settings_name_their_key(override, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        load_config("examples/tiny_cpu.yaml", [override])


def test_blank_call_end_is_refused():
    config = ToolsConfig(call_end=" \n")
    with pytest.raises(ConfigError, match="^rollout.tools.call_end: "):
        config.validate()


def test_async_mode_with_tools_loads_with_and_without_partial_rollouts():
    for partial in ("true", "false"):
        config = load_config("examples/tiny_cpu.yaml", ["rollout.tools.enabled=true", "rollout.mode=async",
                                                        f"rollout.partial_rollouts={partial}"])
        assert config.rollout.tools.enabled and config.rollout.mode == "async"
