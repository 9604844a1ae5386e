"""One cgroup per sandboxed call: its memory (shared memory, memfds and its tmpfs folders included), its process
count and its CPU time, for all of the call's processes together.

Found once when the sandbox starts (:meth:`CallCgroups.find`), from ``/proc/self/mountinfo`` and
``/proc/self/cgroup``:

- **cgroup v2** (one ``cgroup2`` mount whose cgroups offer ``memory`` and ``pids``): a folder
  ``dapo-sandbox-<pid>-<token>`` under the parent cgroup (``sandbox.cgroup_parent``, else the trainer's own), with
  ``+memory +pids`` in the parent's and its own ``cgroup.subtree_control``, and one ``call-<n>`` cgroup below it
  per call. The kernel refuses controllers under a cgroup that holds processes itself (the trainer's own cgroup,
  unless it is the root), so outside the root a ``cgroup_parent`` without processes is needed; the refusal says so.
- **cgroup v1** (``memory``, ``pids`` and ``cpuacct`` each mounted as a hierarchy, as on Debian with the hybrid
  layout and in many containers): the same folders in each of the three hierarchies.

A call's cgroup: ``memory.max`` / ``memory.limit_in_bytes`` with swap held at zero (``memory.swap.max`` /
``memory.memsw.limit_in_bytes``), ``pids.max``, and its CPU time read from ``cpu.stat`` / ``cpuacct.usage`` by the
trainer, which ends the call when the total passes the limit (no cgroup knob bounds total CPU time). The process
is moved in before it starts bubblewrap (:mod:`dapo_megatron.tools.sandbox_process`), so every process of the call
is counted. A call's cgroup is emptied (SIGKILL to what is left) and removed when the call ends; the folder of the
run's calls when the sandbox closes, and at the next start if the trainer was killed.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import secrets
import signal
import time
from dataclasses import dataclass

V1_CONTROLLERS = ("memory", "pids", "cpuacct")
V2_CONTROLLERS = ("memory", "pids")
BASE_PREFIX = "dapo-sandbox-"
REMOVE_WAIT_S = 5.0  # a call's last processes leave its cgroup as the kernel tears its namespaces down


class CgroupUnavailable(Exception):
    """No cgroup can be made for the calls here; the message says why."""


@dataclass(frozen=True)
class Mount:
    root: str  # the cgroup path the mount shows at its mount point
    point: str
    fstype: str  # "cgroup" (v1) or "cgroup2"
    controllers: frozenset[str]  # v1: the controllers of the hierarchy (from its super options)


def parse_mountinfo(text: str) -> list[Mount]:
    """The cgroup mounts of a ``/proc/<pid>/mountinfo``."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        separator = fields.index("-")
        fstype, super_options = fields[separator + 1], fields[separator + 3] if len(fields) > separator + 3 else ""
        if fstype in ("cgroup", "cgroup2"):
            options = frozenset(super_options.split(",")) if fstype == "cgroup" else frozenset()
            mounts.append(Mount(_unescape(fields[3]), _unescape(fields[4]), fstype, options))
    return mounts


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/<pid>/cgroup`` as {controller: path}; the v2 path under the key ``""``."""
    paths = {}
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def hierarchy_dir(mount: Mount, path: str) -> str:
    """The folder of cgroup ``path`` under ``mount``."""
    root = mount.root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        raise CgroupUnavailable(f"the cgroup {path} is outside what {mount.point} shows ({mount.root})")
    inside = path[len(root):].lstrip("/")
    return os.path.join(mount.point, inside) if inside else mount.point


def plan_dirs(mounts: list[Mount], paths: dict[str, str], parent: str | None) -> tuple[int, list[str]]:
    """(cgroup version, the parent folders to make the calls' cgroups in): v2 if its mount offers memory and pids
    in the parent cgroup, else v1 if memory, pids and cpuacct are each mounted, else :class:`CgroupUnavailable`."""
    unified = [m for m in mounts if m.fstype == "cgroup2"]
    if unified and "" in paths:
        folder = hierarchy_dir(unified[0], parent or paths[""])
        if set(V2_CONTROLLERS) <= set(_read(os.path.join(folder, "cgroup.controllers"), "").split()):
            return 2, [folder]
    folders = []
    for controller in V1_CONTROLLERS:
        mount = next((m for m in mounts if m.fstype == "cgroup" and controller in m.controllers), None)
        if mount is None or controller not in paths:
            raise CgroupUnavailable(f"no cgroup v2 with the memory and pids controllers and no cgroup v1 "
                                    f"'{controller}' hierarchy is mounted")
        folder = hierarchy_dir(mount, parent or paths[controller])
        if folder not in folders:
            folders.append(folder)  # cpu and cpuacct may share a hierarchy; memory and pids never do
    return 1, folders


class CallCgroups:
    """The folder(s) this trainer makes its calls' cgroups in."""

    def __init__(self, version: int, parents: list[str]):
        self.version = version
        name = f"{BASE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._bases = [os.path.join(parent, name) for parent in parents]
        self._numbers = itertools.count()
        for parent in parents:
            remove_stale(parent)
        try:
            for parent, base in zip(parents, self._bases):
                if version == 2:
                    _enable_controllers(parent)
                os.mkdir(base)
                if version == 2:
                    _enable_controllers(base)
        except OSError as error:
            self.close()
            raise CgroupUnavailable(f"cannot make a cgroup under {error.filename or parents[0]}: "
                                    f"{error.strerror}") from None

    @classmethod
    def find(cls, parent: str | None = None, proc: str = "/proc/self") -> "CallCgroups":
        with open(f"{proc}/mountinfo") as mountinfo, open(f"{proc}/cgroup") as cgroup:
            version, parents = plan_dirs(parse_mountinfo(mountinfo.read()), parse_proc_cgroup(cgroup.read()),
                                         parent)
        return cls(version, parents)

    def create(self) -> "CallCgroup":
        name = f"call-{next(self._numbers)}"
        return CallCgroup(self.version, [os.path.join(base, name) for base in self._bases])

    def close(self) -> None:
        for base in self._bases:
            _remove_tree(base)


class CallCgroup:
    """One call's cgroup (v1: one folder per hierarchy)."""

    def __init__(self, version: int, folders: list[str]):
        self.version = version
        self.folders = folders
        made = []
        try:
            for folder in folders:
                os.mkdir(folder)
                made.append(folder)
        except OSError:
            for folder in made:
                os.rmdir(folder)
            raise

    def limit(self, memory_bytes: int, processes: int) -> None:
        if self.version == 2:
            self._write("memory.max", memory_bytes)
            self._write("memory.swap.max", 0, required=False)
            self._write("memory.oom.group", 1, required=False)  # an OOM kill ends the whole call
        else:
            self._write("memory.limit_in_bytes", memory_bytes)
            self._write("memory.memsw.limit_in_bytes", memory_bytes, required=False)  # no swap beyond it
        self._write("pids.max", processes)

    def attach(self, pid: int) -> None:
        for folder in self.folders:
            _write_file(os.path.join(folder, "cgroup.procs"), pid)

    def cpu_seconds(self) -> float:
        if self.version == 2:
            return _stat(self._path("cpu.stat"), "usage_usec") / 1e6
        return int(_read(self._path("cpuacct.usage"), "0")) / 1e9

    def oom_kills(self) -> int:
        return _stat(self._path("memory.events" if self.version == 2 else "memory.oom_control"), "oom_kill")

    def kill_all(self) -> None:
        if self.version == 2 and os.path.exists(self._path("cgroup.kill")):
            _write_file(self._path("cgroup.kill"), 1)
            return
        for folder in self.folders:
            for pid in _read(os.path.join(folder, "cgroup.procs"), "").split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def remove(self, wait_s: float = REMOVE_WAIT_S) -> bool:
        """Kill what is left and remove the cgroup; False if a folder is still busy after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        left = list(self.folders)
        while left:
            self.kill_all()
            for folder in list(left):
                try:
                    os.rmdir(folder)
                    left.remove(folder)
                except FileNotFoundError:
                    left.remove(folder)
                except OSError as error:
                    if error.errno != errno.EBUSY or time.monotonic() > deadline:
                        return False
            if left:
                time.sleep(0.005)
        return True

    def _path(self, name: str) -> str:
        for folder in self.folders:
            path = os.path.join(folder, name)
            if os.path.exists(path):
                return path
        return os.path.join(self.folders[0], name)

    def _write(self, name: str, value: int, required: bool = True) -> None:
        path = self._path(name)
        if required or os.path.exists(path):
            _write_file(path, value)


def remove_stale(parent: str) -> None:
    """Remove the empty call cgroups of trainers that are gone (killed before they could)."""
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        match = re.fullmatch(rf"{BASE_PREFIX}(\d+)-[0-9a-f]+", entry)
        if match and not _alive(int(match.group(1))):
            _remove_tree(os.path.join(parent, entry))


def _remove_tree(base: str) -> None:
    try:
        for entry in os.listdir(base):
            if entry.startswith("call-"):
                try:
                    os.rmdir(os.path.join(base, entry))
                except OSError:
                    pass
        os.rmdir(base)
    except OSError:
        pass


def _enable_controllers(folder: str) -> None:
    enabled = _read(os.path.join(folder, "cgroup.subtree_control"), "").split()
    missing = [c for c in V2_CONTROLLERS if c not in enabled]
    if missing:
        _write_file(os.path.join(folder, "cgroup.subtree_control"), " ".join(f"+{c}" for c in missing))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _stat(path: str, key: str) -> int:
    for line in _read(path, "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _read(path: str, default: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return default


def _write_file(path: str, value) -> None:
    with open(path, "w") as file:
        file.write(str(value))


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
