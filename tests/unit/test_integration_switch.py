"""DAPO_REQUIRE_INTEGRATION=1 (set by scripts/test.sh's full mode) turns skipped SLURM/SGLang tests into failures
that carry the skip's reason; without it they skip, and other tests' skips are untouched either way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/: its conftest.py and the helpers that conftest imports

SAMPLE = '''
import pytest

pytestmark = pytest.mark.slurm


@pytest.mark.skipif(True, reason="no cluster here")
def test_needs_slurm():
    pass


@pytest.mark.sglang
def test_needs_sglang_and_slurm():
    pytest.skip("sglang is not importable")


def test_runs():
    pass
'''

OTHER = '''
import pytest


def test_optional_dependency():
    pytest.skip("math_verify is not installed")
'''


def _run(tmp_path: Path, required: bool) -> subprocess.CompletedProcess:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(TESTS.parent / "pyproject.toml", tmp_path / "pyproject.toml")  # the pytest markers
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_other.py").write_text(OTHER)
    env = {k: v for k, v in os.environ.items() if k != "DAPO_REQUIRE_INTEGRATION"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p)  # the helpers it imports
    if required:
        env["DAPO_REQUIRE_INTEGRATION"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:warnings",
                           str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_without_the_switch_integration_tests_skip(tmp_path):
    result = _run(tmp_path, required=False)
    assert result.returncode == 0, result.stdout
    assert "3 skipped" in result.stdout and "1 passed" in result.stdout, result.stdout


def test_with_the_switch_skipped_integration_tests_fail_with_the_reason(tmp_path):
    result = _run(tmp_path, required=True)
    assert result.returncode == 1, result.stdout
    # a skip in setup (skipif) is reported as an error, one inside the test as a failure: both fail the run
    assert "1 failed, 1 passed, 1 skipped, 1 error" in result.stdout, result.stdout
    assert "this slurm test must run, but it was skipped: no cluster here" in result.stdout, result.stdout
    assert ("this slurm/sglang test must run, but it was skipped: sglang is not importable"
            in result.stdout), result.stdout
    assert "SKIPPED [1] test_other.py:6: math_verify is not installed" in result.stdout, result.stdout
