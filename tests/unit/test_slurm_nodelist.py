"""launch_env.expand_nodelist / launch_env under SLURM variables, with the built-in parser and with `scontrol`.

Fast: no cluster needed (``scontrol show hostnames`` expands a host list locally from slurm.conf, so those cases
run only where SLURM's client and configuration are installed).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from dapo_megatron import launch_env as launch

NODELISTS = {
    "node[01-04]": ["node01", "node02", "node03", "node04"],
    "a1,b2": ["a1", "b2"],
    "gpu-[1,3-5]": ["gpu-1", "gpu-3", "gpu-4", "gpu-5"],
    "n[1-2]-ib,x": ["n1-ib", "n2-ib", "x"],
    "n[8-10]": ["n8", "n9", "n10"],  # widths grow inside a range that is not zero-padded
    "n[008-010,012]": ["n008", "n009", "n010", "n012"],
    "a[1-2]b[3-4]": ["a1b3", "a1b4", "a2b3", "a2b4"],
    "x[1-2],y[3],z": ["x1", "x2", "y3", "z"],
}


def _scontrol_works() -> bool:
    if not shutil.which("scontrol"):
        return False
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", "a[1-2]"], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:  # no slurm.conf: scontrol retries for a minute
        return False
    return out.stdout.split() == ["a1", "a2"]


needs_scontrol = pytest.mark.skipif(not _scontrol_works(),
                                    reason="`scontrol show hostnames` not usable here (no SLURM client/config)")


@pytest.fixture
def without_scontrol(monkeypatch, tmp_path):
    """PATH without scontrol, so expand_nodelist takes its built-in parser."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("scontrol") is None


@pytest.mark.parametrize("nodelist,hosts", NODELISTS.items())
def test_builtin_parser(without_scontrol, nodelist, hosts):
    assert launch.expand_nodelist(nodelist) == hosts


@needs_scontrol
@pytest.mark.parametrize("nodelist,hosts", NODELISTS.items())
def test_with_scontrol(nodelist, hosts):
    assert launch.expand_nodelist(nodelist) == hosts


@needs_scontrol
@pytest.mark.parametrize("nodelist", [k for k in NODELISTS if k != "n[1-2]-ib,x"])
def test_builtin_parser_agrees_with_scontrol(nodelist):
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
    assert launch.parse_nodelist(nodelist) == out.stdout.split()


@needs_scontrol
def test_scontrol_rejects_a_suffix_after_brackets_and_platform_falls_back():
    """SLURM 22.05's scontrol prints "Invalid hostlist" for ``n[1-2]-ib,x`` (exit 0, nothing on stdout):
    expand_nodelist must then use its own parser, which the case above checks gives the right hosts."""
    out = subprocess.run(["scontrol", "show", "hostnames", "n[1-2]-ib,x"], capture_output=True, text=True, timeout=10)
    if out.stdout.split():
        pytest.skip(f"this scontrol expands the form itself: {out.stdout.split()}")
    assert launch.expand_nodelist("n[1-2]-ib,x") == NODELISTS["n[1-2]-ib,x"]


@pytest.mark.parametrize("bad", ["node[01-04", "n[4-2]", "n[a-b]", "  "])
def test_bad_nodelists_are_named(without_scontrol, bad):
    with pytest.raises(launch.LaunchError):
        launch.expand_nodelist(bad)


@pytest.mark.parametrize("use_scontrol", [False, True], ids=["builtin", "scontrol"])
@pytest.mark.parametrize("nodelist,hosts", NODELISTS.items())
def test_launch_env_from_slurm_variables(monkeypatch, tmp_path, use_scontrol, nodelist, hosts):
    if use_scontrol and not _scontrol_works():
        pytest.skip("`scontrol show hostnames` not usable here")
    if not use_scontrol:
        monkeypatch.setenv("PATH", str(tmp_path))
    world = 2 * len(hosts)  # two tasks per node, block distribution: task t on host t // 2
    for procid in range(world):
        env = {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(procid % 2),
               "SLURM_NODEID": str(procid // 2), "SLURM_JOB_NODELIST": nodelist, "MASTER_PORT": "23456"}
        got = launch.launch_env(env)
        assert got == launch.LaunchEnv(rank=procid, world_size=world, local_rank=procid % 2,
                                       master_addr=hosts[0], master_port=23456, launcher="slurm")


def test_launch_env_prefers_an_exported_master_addr():
    """The SGLang sbatch script exports the first *trainer* node, which is not the job's first node."""
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "n[1-3]",
           "MASTER_ADDR": "n2"}
    got = launch.launch_env(env)
    assert (got.rank, got.world_size, got.local_rank, got.master_addr) == (3, 4, 1, "n2")
    assert got.master_port == launch.DEFAULT_MASTER_PORT


def test_launch_env_outside_srun_names_what_is_missing():
    with pytest.raises(launch.LaunchError, match="SLURM_LOCALID"):
        launch.launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"})
