"""The install check (scripts/check_installs.py), the lock files in constraints/ and the packaging in pyproject.toml."""

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_installs", ROOT / "scripts" / "check_installs.py")
check_installs = importlib.util.module_from_spec(_spec)
sys.modules["check_installs"] = check_installs  # its dataclasses look their module up there
_spec.loader.exec_module(check_installs)

README_EXAMPLE = """# x

## Quick start

```bash
pip install not-this-one
```

## Installation

```bash
python3.11 -m venv .venv
.venv/bin/pip install -c constraints/gpu-trainer.txt -e '.[dev]'
.venv/bin/pip install wheel  # a comment
pip list
```

## Next

```bash
pip install nor-this-one
```
"""


def test_install_lines_are_read_from_the_installation_section_only():
    commands = check_installs.documented_installs(README_EXAMPLE)
    assert [command.arguments for command in commands] == [
        ["-c", "constraints/gpu-trainer.txt", "-e", ".[dev]"],
        ["wheel"],
    ]


def test_the_readme_documents_both_gpu_environments():
    commands = check_installs.documented_installs((ROOT / "README.md").read_text())
    constraints = {command.arguments[command.arguments.index("-c") + 1] for command in commands
                   if "-c" in command.arguments}
    assert constraints == {"constraints/gpu-trainer.txt", "constraints/gpu-sglang.txt"}
    for constraint in constraints:
        assert (ROOT / constraint).is_file()


def test_gpu_locks_share_torch_and_nccl():
    assert check_installs.runtime_disagreements() == []
    trainer, server = (check_installs.pins(lock) for lock in check_installs.GPU_LOCKS)
    assert trainer["torch"] == server["torch"] == "2.14.1"


def test_a_lock_with_another_nccl_is_named(tmp_path):
    """Control for the test above: the comparison reports a differing NCCL with both versions."""
    trainer, server = tmp_path / "trainer.txt", tmp_path / "server.txt"
    trainer.write_text("# header\ntorch==2.14.1\nnvidia-nccl-cu13==2.30.7\n")
    server.write_text("torch==2.14.1\nnvidia-nccl-cu13==2.29.7\n")
    assert check_installs.runtime_disagreements((trainer, server)) == [
        "nvidia-nccl-cu13: trainer.txt pins 2.30.7, server.txt pins 2.29.7"]
    server.write_text("nvidia-nccl-cu13==2.30.7\n")
    assert check_installs.runtime_disagreements((trainer, server)) == [
        "torch: trainer.txt pins 2.14.1, server.txt pins nothing"]


def test_cpu_lock_follows_the_trainer_lock_except_the_torch_family():
    cpu, trainer = (check_installs.pins(ROOT / "constraints" / name) for name in ("cpu.txt", "gpu-trainer.txt"))
    assert cpu["torch"] == "2.13.0+cpu"
    differing = {name for name in cpu.keys() & trainer.keys() if cpu[name] != trainer[name]}
    assert differing == {"torch"}


def test_pyproject_names_its_console_scripts_and_keeps_package_data():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for target in project["project"]["scripts"].values():
        module_name, function_name = target.split(":")
        module = importlib.import_module(module_name)
        assert callable(getattr(module, function_name))
    package_data = project["tool"]["setuptools"]["package-data"]["dapo_megatron"]
    for pattern in package_data:
        assert list((ROOT / "dapo_megatron").glob(pattern)), pattern


@pytest.mark.slow
def test_documented_installs_resolve_and_a_conflicting_pin_fails(tmp_path):
    """Against the registry: the README's installs resolve; adding SGLang's transformers pin to them must not."""
    script = [sys.executable, str(ROOT / "scripts" / "check_installs.py")]
    passed = subprocess.run(script, capture_output=True, text=True, timeout=600)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    conflict = tmp_path / "conflict.txt"
    conflict.write_text("transformers==5.19.0\n")
    failed = subprocess.run(script + ["--constraint", str(conflict)], capture_output=True, text=True, timeout=600)
    assert failed.returncode == 1
    assert "DOES NOT RESOLVE: .venv/bin/pip install -c constraints/gpu-trainer.txt -e '.[dev]'" in failed.stdout
    assert "transformers==5.19.0" in failed.stdout
