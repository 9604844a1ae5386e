"""The seccomp filter of the code sandbox: a classic BPF program, assembled here, that bubblewrap installs
(``--seccomp FD``) right before it starts the interpreter, so it holds for the code and everything it starts.

What it refuses (``EPERM``) is what model-written Python has no use for and what would reach past the sandbox's
namespaces: the kernel keyrings (``keyctl``, ``add_key``, ``request_key``: keys outlive a call and are shared by
uid), namespaces and mounts, other processes' memory and tracing, kernel modules, clocks, swap, NUMA placement,
io_uring, eBPF and perf. ``clone`` with a namespace flag is refused too, and ``clone3`` answers ``ENOSYS`` (its
flags sit in memory a filter cannot read), so the C library falls back to ``clone``, whose flags it can.
Threads, ``fork``/``subprocess``, files, pipes and sockets in the sandbox's own network namespace stay allowed.

A syscall of another ABI than the machine's (32-bit ``int 0x80`` on x86-64, the x32 ABI) is refused whole: the
numbers below are the machine's own, and another ABI numbers syscalls differently.

The numbers come from the kernel's tables (``arch/x86/entry/syscalls/syscall_64.tbl``, ``include/uapi/asm-generic/
unistd.h`` for arm64); ``tests/unit/test_seccomp.py`` checks them against libseccomp's tables.
"""

from __future__ import annotations

import errno
import platform
import struct

# AUDIT_ARCH_* values: what ``seccomp_data.arch`` holds for a syscall of that ABI.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000

# What each refused syscall is numbered on each machine (None: the machine has no such syscall).
REFUSED = {
    # the kernel keyrings
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    # namespaces and mounts
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "chroot": (161, 51), "mount_setattr": (442, 442), "move_mount": (429, 429), "open_tree": (428, 428),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    # other processes, tracing, handles that bypass paths
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "pidfd_getfd": (438, 438), "perf_event_open": (298, 241), "bpf": (321, 280), "userfaultfd": (323, 282),
    "fanotify_init": (300, 262), "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "lookup_dcookie": (212, 18),
    # the kernel, the machine's clocks and devices
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "reboot": (169, 142), "swapon": (167, 224), "swapoff": (168, 225),
    "syslog": (103, 116), "acct": (163, 89), "quotactl": (179, 60), "quotactl_fd": (443, 443),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266), "adjtimex": (159, 171),
    "sethostname": (170, 161), "setdomainname": (171, 162), "vhangup": (153, 58), "personality": (135, 92),
    "iopl": (172, None), "ioperm": (173, None), "modify_ldt": (154, None), "uselib": (134, None),
    "_sysctl": (156, None),
    # NUMA placement (reaches other processes' memory: migrate_pages, move_pages)
    "mbind": (237, 235), "set_mempolicy": (238, 237), "migrate_pages": (256, 238), "move_pages": (279, 239),
    # io_uring: a second syscall interface this filter would not see
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
}
CLONE = {"x86_64": 56, "aarch64": 220}
CLONE3 = {"x86_64": 435, "aarch64": 435}
# CLONE_NEWTIME, CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET
CLONE_NAMESPACE_FLAGS = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

# Classic BPF (linux/filter.h, linux/seccomp.h)
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
NR_OFFSET, ARCH_OFFSET, ARG0_LOW_OFFSET = 0, 4, 16  # in struct seccomp_data (little-endian: arg 0's low half)
MAX_JUMP = 255


def refused_syscalls(machine: str) -> dict[str, int]:
    """The syscalls the filter refuses on ``machine`` (``platform.machine()``), by name."""
    column = _column(machine)
    return {name: numbers[column] for name, numbers in REFUSED.items() if numbers[column] is not None}


def filter_program(machine: str | None = None) -> bytes:
    """The filter as bubblewrap reads it from ``--seccomp FD``: ``struct sock_filter`` records, 8 bytes each."""
    machine = machine or platform.machine()
    _column(machine)
    program = Program()
    program.load(ARCH_OFFSET)
    program.jump_unless(JEQ_K, AUDIT_ARCH[machine], "refuse")
    program.load(NR_OFFSET)
    if machine == "x86_64":
        program.jump_if(JGE_K, X32_SYSCALL_BIT, "refuse")
    for number in sorted(set(refused_syscalls(machine).values())):
        program.jump_if(JEQ_K, number, "refuse")
    program.jump_if(JEQ_K, CLONE3[machine], "no_such_call")
    program.jump_unless(JEQ_K, CLONE[machine], "allow")
    program.load(ARG0_LOW_OFFSET)
    program.jump_if(JSET_K, CLONE_NAMESPACE_FLAGS, "refuse")
    program.label("allow")
    program.ret(RET_ALLOW)
    program.label("refuse")
    program.ret(RET_ERRNO | errno.EPERM)
    program.label("no_such_call")
    program.ret(RET_ERRNO | errno.ENOSYS)
    return program.assemble()


class Program:
    """A classic BPF program with forward jumps to named labels, resolved by :meth:`assemble`."""

    def __init__(self):
        self._code: list[tuple[int, int, int | str, int | str]] = []  # (op, k, jump if true, jump if false)
        self._labels: dict[str, int] = {}

    def load(self, offset: int) -> None:
        self._code.append((LD_W_ABS, offset, 0, 0))

    def jump_if(self, op: int, k: int, label: str) -> None:
        self._code.append((op, k, label, 0))

    def jump_unless(self, op: int, k: int, label: str) -> None:
        self._code.append((op, k, 0, label))

    def ret(self, value: int) -> None:
        self._code.append((RET_K, value, 0, 0))

    def label(self, name: str) -> None:
        self._labels[name] = len(self._code)

    def assemble(self) -> bytes:
        records = []
        for index, (op, k, if_true, if_false) in enumerate(self._code):
            records.append(struct.pack("=HBBI", op, self._offset(index, if_true), self._offset(index, if_false), k))
        return b"".join(records)

    def _offset(self, index: int, target: int | str) -> int:
        if isinstance(target, int):
            return target
        offset = self._labels[target] - index - 1  # BPF jumps count from the next instruction
        if not 0 <= offset <= MAX_JUMP:
            raise ValueError(f"seccomp filter: jump to {target!r} spans {offset} instructions (0..{MAX_JUMP})")
        return offset


def _column(machine: str) -> int:
    if machine not in AUDIT_ARCH:
        raise ValueError(f"the sandbox's seccomp filter knows the syscalls of {sorted(AUDIT_ARCH)}, not "
                         f"{machine!r}")
    return list(AUDIT_ARCH).index(machine)
