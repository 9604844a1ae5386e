"""Your own tools (rollout.tools.functions): name(text, metadata) -> str run in a process of its own per call, with
the tool's timeout; whatever the function does comes back as a counted ToolResult."""

import time

import pytest

from dapo_megatron.tools import FunctionToolConfig, ToolPool, ToolsConfig

TOOLS = '''
import os, signal, sys, time

def echo(text, metadata):
    print("a debug print")  # goes to the trainer's stderr, not into the answer
    return f"{text.upper()} {sorted(metadata.items())}"

def sleepy(text, metadata):
    time.sleep(60)

def number(text, metadata):
    return 3

def raises(text, metadata):
    raise RuntimeError("the index is down")

def dies(text, metadata):
    os.kill(os.getpid(), signal.SIGKILL)

def long(text, metadata):
    return "y" * 5000
'''


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(TOOLS)
    names = ("echo", "sleepy", "number", "raises", "dies", "long")
    timeouts = {"sleepy": 1.5}
    config = ToolsConfig(code=False, pool_size=6, functions=[
        FunctionToolConfig(function=f"{path}:{name}", timeout_s=timeouts.get(name, 30.0), output_bytes=1000)
        for name in names])
    tool_pool = ToolPool(config)
    yield tool_pool
    tool_pool.close()


def test_answer_with_metadata_and_prints_kept_apart(pool, capfd):
    result = pool.call("echo", "find x", {"data_source": "math", "turn": 2})
    assert result.ok, result
    assert result.text == "FIND X [('data_source', 'math'), ('turn', 2)]"
    assert "a debug print" in capfd.readouterr().err


@pytest.mark.parametrize("name, kind, needle", [
    ("sleepy", "timeout", "no answer from sleepy within 1.5 s"),
    ("number", "error", "returned int, expected str"),
    ("raises", "error", "RuntimeError: the index is down (at "),
    ("dies", "killed", "SIGKILL"),
    ("long", "output_limit", "longer than 1000 bytes"),
])
def test_failures_are_counted_results(pool, name, kind, needle):
    before = pool.counts()
    result = pool.call(name, "x", {})
    assert (result.ok, result.kind) == (False, kind), result
    assert needle in result.text
    assert result.wall_s < 10.0
    after = pool.counts()
    assert after[f"tools/{name}/failed"] - before[f"tools/{name}/failed"] == 1
    assert after[f"tools/failed/{kind}"] - before[f"tools/failed/{kind}"] == 1


def test_calls_run_side_by_side_and_the_caller_survives(pool):
    start = time.monotonic()
    futures = [pool.submit("sleepy", "x", {}) for _ in range(2)] + [pool.submit("echo", "y", {}) for _ in range(3)]
    results = [future.result() for future in futures]
    assert [r.kind for r in results] == ["timeout", "timeout", None, None, None]
    assert time.monotonic() - start < 2 * 1.5  # the two timeouts ran at once


def test_metadata_that_is_not_json_is_refused(pool):
    result = pool.call("echo", "x", {"tensor": object()})
    assert (result.ok, result.kind) == (False, "refused") and "metadata is not JSON" in result.text
