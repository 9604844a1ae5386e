"""Where the sandbox makes its calls' cgroups (dapo_megatron/tools/cgroups.py): read from a process's mountinfo
and cgroup files, for the layouts it meets — cgroup v2 (with and without a parent that offers memory and pids),
v1 as on the CI machine (Debian's hybrid layout: v1 controllers, an empty v2 at /sys/fs/cgroup/unified), v1 in a
container without a cgroup namespace — and none. The cgroups themselves, made and used for real, are in
tests/integration/test_sandbox_layers.py."""

from __future__ import annotations

import pytest

from dapo_megatron.tools.cgroups import (CgroupUnavailable, Mount, hierarchy_dir, parse_mountinfo,
                                         parse_proc_cgroup, plan_dirs)

HYBRID_MOUNTINFO = """\
30 24 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
33 30 0:29 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:14 - cgroup cgroup rw,memory
34 30 0:30 / /sys/fs/cgroup/pids rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,pids
35 30 0:31 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:16 - cgroup cgroup rw,cpu,cpuacct
"""
HYBRID_CGROUP = """\
12:pids:/user.slice/user-1000.slice
11:cpu,cpuacct:/user.slice
9:memory:/user.slice/user-1000.slice/session-3.scope
0::/user.slice/user-1000.slice/session-3.scope
"""


def test_mountinfo_and_cgroup_files_are_read():
    mounts = parse_mountinfo(HYBRID_MOUNTINFO)
    assert [m.point for m in mounts] == ["/sys/fs/cgroup/unified", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids",
                                         "/sys/fs/cgroup/cpu,cpuacct"]
    assert mounts[3].controllers == {"rw", "cpu", "cpuacct"} and mounts[0].fstype == "cgroup2"
    paths = parse_proc_cgroup(HYBRID_CGROUP)
    assert paths["cpuacct"] == paths["cpu"] == "/user.slice" and paths[""].endswith("session-3.scope")
    escaped = parse_mountinfo("40 30 0:40 / /sys/fs/cgroup/with\\040space rw - cgroup cgroup rw,pids\n")
    assert escaped[0].point == "/sys/fs/cgroup/with space"


def test_the_hybrid_layout_uses_the_v1_hierarchies(tmp_path):
    # The v2 mount offers no controller (they are all bound to v1 hierarchies): v1, one folder per hierarchy.
    mounts = [Mount(m.root, str(tmp_path) + m.point, m.fstype, m.controllers)
              for m in parse_mountinfo(HYBRID_MOUNTINFO)]
    (tmp_path / "sys/fs/cgroup/unified/user.slice/user-1000.slice/session-3.scope").mkdir(parents=True)
    version, folders = plan_dirs(mounts, parse_proc_cgroup(HYBRID_CGROUP), None)
    base = f"{tmp_path}/sys/fs/cgroup"
    assert version == 1
    assert folders == [f"{base}/memory/user.slice/user-1000.slice/session-3.scope",
                       f"{base}/pids/user.slice/user-1000.slice", f"{base}/cpu,cpuacct/user.slice"]
    version, folders = plan_dirs(mounts, parse_proc_cgroup(HYBRID_CGROUP), "/sandbox")
    assert folders == [f"{base}/memory/sandbox", f"{base}/pids/sandbox", f"{base}/cpu,cpuacct/sandbox"]


def test_v2_is_used_where_the_parent_offers_memory_and_pids(tmp_path):
    mounts = [Mount("/", str(tmp_path), "cgroup2", frozenset())]
    paths = {"": "/trainer.scope"}
    (tmp_path / "trainer.scope").mkdir()
    (tmp_path / "trainer.scope" / "cgroup.controllers").write_text("cpu io memory pids\n")
    assert plan_dirs(mounts, paths, None) == (2, [str(tmp_path / "trainer.scope")])
    (tmp_path / "sandbox").mkdir()
    (tmp_path / "sandbox" / "cgroup.controllers").write_text("cpu io\n")  # no memory, no pids delegated there
    with pytest.raises(CgroupUnavailable, match="no cgroup v2 with the memory and pids controllers"):
        plan_dirs(mounts, paths, "/sandbox")


def test_no_cgroup_mounted_is_unavailable():
    with pytest.raises(CgroupUnavailable, match="no cgroup v1 'memory' hierarchy is mounted"):
        plan_dirs([], {"memory": "/"}, None)


def test_a_cgroup_outside_the_mounted_part_is_unavailable():
    # A container without a cgroup namespace mounts only its own part of the hierarchy.
    mount = Mount("/docker/abc", "/sys/fs/cgroup/memory", "cgroup", frozenset({"memory"}))
    assert hierarchy_dir(mount, "/docker/abc/trainer") == "/sys/fs/cgroup/memory/trainer"
    assert hierarchy_dir(mount, "/docker/abc") == "/sys/fs/cgroup/memory"
    with pytest.raises(CgroupUnavailable, match="outside what /sys/fs/cgroup/memory shows"):
        hierarchy_dir(mount, "/docker/abcdef")
