"""A fresh session keyring for each sandboxed call.

A process inherits its creator's session keyring, and possessing a keyring grants what its "possessor" permissions
allow: a sandbox started from a trainer that has one (pam_keyinit logins, many container runtimes) could read the
trainer's keys and leave keys for the next call. bubblewrap has no option for it, so the thread that starts the
sandbox joins a new anonymous session keyring first (``keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)``): a thread's
keyrings are its own credentials, so the trainer's other threads keep theirs, and the sandbox, forked from that
thread, starts with a keyring nothing else holds. The seccomp filter then keeps the code from touching keyrings at
all (:mod:`dapo_megatron.tools.seccomp`).
"""

from __future__ import annotations

import ctypes
import os
import platform

from dapo_megatron.tools.seccomp import refused_syscalls

KEYCTL_GET_KEYRING_ID = 0
KEYCTL_JOIN_SESSION_KEYRING = 1
KEY_SPEC_SESSION_KEYRING = -3


def join_fresh_session_keyring() -> int:
    """Give the calling thread a new, empty anonymous session keyring; its serial number."""
    return _keyctl(KEYCTL_JOIN_SESSION_KEYRING, None)


def session_keyring_id() -> int:
    """The serial number of the calling thread's session keyring (made if it has none)."""
    return _keyctl(KEYCTL_GET_KEYRING_ID, ctypes.c_long(KEY_SPEC_SESSION_KEYRING), ctypes.c_long(1))


def _keyctl(*args) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    number = refused_syscalls(platform.machine())["keyctl"]
    result = libc.syscall(ctypes.c_long(number), ctypes.c_long(args[0]), *args[1:])
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"keyctl: {os.strerror(code)}")
    return result
