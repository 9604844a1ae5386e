"""The top-level setup.py (the design card's layout) is setuptools' thin shim over pyproject.toml: run as a script, it
reports the package's one version, ``dapo_megatron.__version__``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dapo_megatron

ROOT = Path(__file__).resolve().parents[2]


def test_setup_py_reports_the_package_version():
    result = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [dapo_megatron.__version__]
