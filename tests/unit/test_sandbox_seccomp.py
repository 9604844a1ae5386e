"""The sandbox's seccomp filter (dapo_megatron/tools/seccomp.py): its numbers against libseccomp's tables, the
program run through a classic-BPF interpreter written here for every syscall number and both machines, and the
program loaded into a real process by the kernel (no bubblewrap): what it refuses is refused, Python still runs."""

from __future__ import annotations

import ctypes
import errno
import json
import platform
import struct
import subprocess
import sys

import pytest

from dapo_megatron.tools.seccomp import (AUDIT_ARCH, CLONE, CLONE3, CLONE_NAMESPACE_FLAGS, REFUSED, RET_ALLOW,
                                         RET_ERRNO, X32_SYSCALL_BIT, filter_program, refused_syscalls)

MACHINES = list(AUDIT_ARCH)
CLONE_THREAD_FLAGS = 0x003D0F00  # what glibc's pthread_create passes to clone
EPERM, ENOSYS = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS


def run_bpf(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """What the classic-BPF ``program`` returns for ``struct seccomp_data`` {nr, arch, ip 0, args [arg0, 0...]}."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    code = list(struct.iter_unpack("=HBBI", program))
    accumulator, pc = 0, 0
    while True:
        op, jump_true, jump_false, k = code[pc]
        if op == 0x20:  # ld [k]
            (accumulator,) = struct.unpack_from("=I", data, k)
            pc += 1
        elif op in (0x15, 0x35, 0x45):  # jeq / jge / jset #k
            taken = {0x15: accumulator == k, 0x35: accumulator >= k, 0x45: bool(accumulator & k)}[op]
            pc += 1 + (jump_true if taken else jump_false)
        elif op == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"unexpected BPF op {op:#x}")


@pytest.mark.parametrize("machine", MACHINES)
def test_the_filter_refuses_exactly_its_table(machine):
    program, arch, refused = filter_program(machine), AUDIT_ARCH[machine], set(refused_syscalls(machine).values())
    for nr in range(1024):
        expected = EPERM if nr in refused else ENOSYS if nr == CLONE3[machine] else RET_ALLOW
        assert run_bpf(program, nr, arch) == expected, (machine, nr)
    assert {"keyctl", "add_key", "request_key", "ptrace", "unshare", "mount", "bpf"} <= set(refused_syscalls(machine))


@pytest.mark.parametrize("machine", MACHINES)
def test_clone_is_refused_only_with_a_namespace_flag(machine):
    program, arch = filter_program(machine), AUDIT_ARCH[machine]
    assert run_bpf(program, CLONE[machine], arch, CLONE_THREAD_FLAGS) == RET_ALLOW  # a thread
    assert run_bpf(program, CLONE[machine], arch, 17) == RET_ALLOW  # fork: SIGCHLD
    for bit in range(32):
        flag = 1 << bit
        if flag & CLONE_NAMESPACE_FLAGS:
            assert run_bpf(program, CLONE[machine], arch, 17 | flag) == EPERM, hex(flag)


def test_other_abis_are_refused_whole():
    program = filter_program("x86_64")
    i386 = 0x40000003  # AUDIT_ARCH_I386: int 0x80 from a 64-bit process
    assert run_bpf(program, 1, i386) == EPERM  # write(2) there, exit(2) here: numbers mean other calls
    assert run_bpf(program, X32_SYSCALL_BIT | 1, AUDIT_ARCH["x86_64"]) == EPERM
    assert run_bpf(filter_program("aarch64"), 4, AUDIT_ARCH["x86_64"]) == EPERM
    with pytest.raises(ValueError, match="not 'riscv64'"):
        filter_program("riscv64")


@pytest.mark.parametrize("machine", MACHINES)
def test_the_numbers_are_libseccomps(machine):
    libseccomp = ctypes.CDLL("libseccomp.so.2")  # Debian's apt depends on it: present wherever apt is
    libseccomp.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    table = refused_syscalls(machine)
    for name in REFUSED:
        theirs = libseccomp.seccomp_syscall_resolve_name_arch(AUDIT_ARCH[machine], name.encode())
        assert table.get(name) == (theirs if theirs >= 0 else None), (machine, name, theirs)
    for name, numbers in (("clone", CLONE), ("clone3", CLONE3)):
        assert libseccomp.seccomp_syscall_resolve_name_arch(AUDIT_ARCH[machine], name.encode()) == numbers[machine]


KERNEL_CHECK = """
import ctypes, errno, json, math, os, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
program = bytes.fromhex(sys.argv[1])
if program:
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    buffer = ctypes.create_string_buffer(program, len(program))
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(Fprog(len(program) // 8, ctypes.addressof(buffer))), 0, 0) == 0
def call(number, *args):
    result = libc.syscall(number, *[ctypes.c_long(a) for a in args])
    return "ok" if result >= 0 else errno.errorcode[ctypes.get_errno()]
numbers = json.loads(sys.argv[2])
seen = {"keyctl": call(numbers["keyctl"], 0, -3), "unshare": call(numbers["unshare"], 0),
        "personality": call(numbers["personality"], 0xFFFFFFFF)}
results = []
thread = threading.Thread(target=results.append, args=(math.factorial(20),))
thread.start(); thread.join()
pid = os.fork()
if pid == 0:
    os._exit(3)
seen["python"] = [results[0], os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]),
                  subprocess.run(["/bin/echo", "sub"], capture_output=True, text=True).stdout.strip()]
print(json.dumps(seen))
"""


def test_the_kernel_enforces_the_filter_and_python_still_runs():
    numbers = json.dumps(refused_syscalls(platform.machine()))

    def run(program: bytes) -> dict:
        completed = subprocess.run([sys.executable, "-c", KERNEL_CHECK, program.hex(), numbers],
                                   capture_output=True, text=True, timeout=60)
        assert completed.returncode == 0, completed.stderr
        return json.loads(completed.stdout)

    filtered = run(filter_program())
    assert filtered == {"keyctl": "EPERM", "unshare": "EPERM", "personality": "EPERM",
                        "python": [2432902008176640000, 3, "sub"]}
    # Control: the same process without the filter reaches the kernel with the same (harmless) calls.
    assert run(b"") == {**filtered, "keyctl": "ok", "unshare": "ok", "personality": "ok"}
