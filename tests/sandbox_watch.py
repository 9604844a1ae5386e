"""What the sandbox probes read from OUTSIDE the sandbox, as the host sees it: processes and their CPU time by uid,
the memory charged to the test process's own cgroup, zombies a process holds, and a thread's session keyring.
None of it asks the sandbox (or the trainer's cgroup of the call) what happened."""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import threading
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
KEYCTL = {"x86_64": 250, "aarch64": 219}[platform.machine()]
ADD_KEY = {"x86_64": 248, "aarch64": 217}[platform.machine()]
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_DESCRIBE, KEYCTL_READ = 0, 1, 6, 11
KEY_SPEC_SESSION_KEYRING = -3


def _stat_fields(pid: str) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # it ended while we looked
        return None
    return text.rsplit(")", 1)[1].split()  # fields from the state (field 3) on; the name may hold spaces


def _uid(pid: str) -> int | None:
    """The real uid of process ``pid`` (from its status: /proc/<pid> itself is root's for non-dumpable ones)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def uid_processes(uid: int) -> int:
    return sum(_uid(entry) == uid for entry in os.listdir("/proc") if entry.isdigit())


def wait_until_no_process(uid: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while uid_processes(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return uid_processes(uid)


def zombies_of(parent: int) -> list[int]:
    """The zombie children of process ``parent``."""
    found = []
    for entry in os.listdir("/proc"):
        fields = _stat_fields(entry) if entry.isdigit() else None
        if fields and fields[0] == "Z" and int(fields[1]) == parent:
            found.append(int(entry))
    return found


class Sampler:
    """Samples something every ``period_s`` in a thread while a ``with`` block runs."""

    def __init__(self, sample, period_s: float = 0.01):
        self._sample, self._period_s = sample, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(self._period_s)


class UidCpuTime(Sampler):
    """CPU seconds (user + system) used by the processes of ``uid`` while the block ran, each process at the last
    value seen (one that ends between two samples loses what it used since the last). A sample reads each process's
    stat; its owner is read once per process (on a loaded machine a sample must stay cheap to come often)."""

    def __init__(self, uid: int, period_s: float = 0.01):
        self._uid, self._ticks, self._owners = uid, {}, {}
        super().__init__(self._read, period_s)

    def _read(self):
        for entry in os.listdir("/proc"):
            fields = _stat_fields(entry) if entry.isdigit() else None
            if not fields:
                continue
            key = (entry, fields[19])  # pid and start time: a reused pid is another process
            if key not in self._owners:
                self._owners[key] = _uid(entry)
            if self._owners[key] == self._uid:  # utime, stime: fields 14 and 15
                self._ticks[key] = max(self._ticks.get(key, 0), int(fields[11]) + int(fields[12]))

    @property
    def seconds(self) -> float:
        return sum(self._ticks.values()) / TICKS


def own_cgroup_memory_file() -> Path:
    """The file the kernel reports the memory charged to this process's cgroup in (v1 or v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.usage_in_bytes")
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup", line[3:].lstrip("/"), "memory.current")
    raise RuntimeError("no memory cgroup found for this process")


class PeakMemoryRise(Sampler):
    """The peak rise, in MB, of the memory charged to this process's cgroup (everything it and its children hold:
    their pages, shared memory, memfds, tmpfs) over its value when the block began."""

    def __init__(self, period_s: float = 0.01):
        self._file = own_cgroup_memory_file()
        self._base = self._peak = None
        super().__init__(self._read, period_s)

    def _read(self):
        value = int(self._file.read_text())
        self._base = value if self._base is None else self._base
        self._peak = max(self._peak or value, value)

    @property
    def mb(self) -> float:
        return (self._peak - self._base) / 2**20


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _keyctl(*args) -> int:
    result = _libc().syscall(ctypes.c_long(KEYCTL), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


def join_session_keyring(name: str) -> int:
    """The calling thread joins (makes) the session keyring ``name``."""
    return _keyctl(KEYCTL_JOIN_SESSION_KEYRING, name.encode())


def add_session_key(description: str, payload: bytes) -> int:
    result = _libc().syscall(ctypes.c_long(ADD_KEY), b"user", description.encode(), payload,
                             ctypes.c_size_t(len(payload)), ctypes.c_long(KEY_SPEC_SESSION_KEYRING))
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


def session_key_descriptions() -> list[str]:
    """The descriptions of the keys in the calling thread's session keyring."""
    buffer = ctypes.create_string_buffer(4096)
    size = _keyctl(KEYCTL_READ, KEY_SPEC_SESSION_KEYRING, buffer, 4096)
    descriptions = []
    for (serial,) in struct.iter_unpack("=i", buffer.raw[:size]):
        text = ctypes.create_string_buffer(512)
        length = _keyctl(KEYCTL_DESCRIBE, serial, text, 512)
        descriptions.append(text.raw[:length].rstrip(b"\0").decode().rsplit(";", 1)[-1])
    return descriptions


def keyring_usage(description: str) -> int:
    """How many references the kernel holds to the keyring ``description`` (/proc/keys, read as root): each
    process that has it as its session keyring holds some."""
    for line in Path("/proc/keys").read_text().splitlines():
        fields = line.split(None, 8)
        if fields[7] == "keyring" and fields[8].split(":", 1)[0] == description:
            return int(fields[2])
    raise LookupError(f"no keyring {description!r} in /proc/keys")
