"""scripts/slurm_cluster.sh refuses what it cannot do with one clear line, at once (fast; starts nothing).

The cluster itself is exercised by the SLURM job tests (test_slurm_jobs.py, test_slurm_multinode.py), which need it
up; these cases fail before any daemon, package or namespace is touched, so they run anywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm_cluster.sh"
BASH = shutil.which("bash")


def _run(*args: str, env: dict[str, str] | None = None, user: str | None = None,
         script: Path = SCRIPT) -> subprocess.CompletedProcess:
    command = [BASH, str(script), *args]
    if user is not None:
        command = ["runuser", "-u", user, "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, env=env)


@pytest.mark.parametrize("nodes", ["1", "x", "201"])
def test_a_bad_node_count_is_named(nodes):
    result = _run("start", "--nodes", nodes)
    assert result.returncode == 1
    assert f"--nodes takes a node count from 2 to 200, got '{nodes}'" in result.stderr


def test_unknown_command_prints_the_usage():
    result = _run("restart")
    assert result.returncode == 2 and "usage:" in result.stderr


def test_not_root_is_refused():
    user = "nobody" if os.geteuid() == 0 else None
    if user is not None and shutil.which("runuser") is None:
        pytest.skip("runuser is not installed: cannot drop root here")
    # `nobody` may not be able to read the checkout (a clone under a private `mktemp -d` folder): it runs copies of
    # the script and the one it sources, in a folder of its own that it can read wherever the checkout lives.
    readable = Path(tempfile.mkdtemp(prefix="slurm_cluster_script_"))
    try:
        readable.chmod(0o755)
        for name in (SCRIPT.name, "netns_nodes.sh"):
            shutil.copy(SCRIPT.parent / name, readable / name)
            (readable / name).chmod(0o644)
        result = _run("start", "--nodes", "3", user=user, script=readable / SCRIPT.name)
    finally:
        shutil.rmtree(readable)
    assert result.returncode == 1, result.stderr
    assert "must run as root" in result.stderr


def test_missing_iproute2_is_named_before_anything_starts(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the iproute2 check comes after the root check")
    for tool in ("id", "dirname", "nsenter", "unshare"):  # what the script runs before it needs `ip`
        if shutil.which(tool):
            (tmp_path / tool).symlink_to(shutil.which(tool))
    result = _run("start", "--nodes", "3", env={"PATH": str(tmp_path)})
    assert result.returncode == 1
    assert "'ip' is not installed (apt-get install iproute2 util-linux)" in result.stderr
