"""The full run's switch (DAPO_REQUIRE_INTEGRATION=1, set by scripts/test.sh without --fast): a skipped test of the
integration tier fails the run, with the skip's reason; other skips stay skips, and without the switch nothing
changes. Runs pytest on a small suite that skips the way tests/test_sglang_server.py does when SGLang is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SUITE = '''
import pytest

@pytest.fixture(scope="module")
def server():
    pytest.skip("SGLang is not importable by the server python /nowhere/python")

@pytest.mark.sglang
def test_needs_a_server(server):
    pass

@pytest.mark.sglang
def test_skips_itself():
    pytest.skip("SGLang is not importable")

def test_optional_extra():
    pytest.skip("math_verify is not installed")
'''


def _run_suite(tmp_path: Path, switch: str | None) -> str:
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        "from integration_required import pytest_runtest_makereport  # noqa: F401\n"
        "def pytest_configure(config):\n    config.addinivalue_line('markers', 'sglang: needs SGLang')\n")
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if k != "DAPO_REQUIRE_INTEGRATION"}
    if switch is not None:
        env["DAPO_REQUIRE_INTEGRATION"] = switch
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(tmp_path)],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    return result.stdout + result.stderr


def test_full_run_fails_on_skipped_integration_tests(tmp_path):
    out = _run_suite(tmp_path, "1")
    assert "1 failed, 1 skipped, 1 error" in out, out  # a skip in a fixture fails the test's setup: an error
    assert "ERROR test_suite.py::test_needs_a_server" in out and "FAILED test_suite.py::test_skips_itself" in out
    assert "may not skip; it skipped with: SGLang is not importable by the server python /nowhere/python" in out
    assert "may not skip; it skipped with: SGLang is not importable\n" in out
    assert "SKIPPED [1] test_suite.py" in out and "math_verify is not installed" in out  # not the integration tier


def test_without_the_switch_integration_tests_skip(tmp_path):
    """The control: the same suite without the switch (the fast mode, a developer's run) skips all three."""
    for switch in (None, "0"):
        assert "3 skipped" in _run_suite(tmp_path, switch)
