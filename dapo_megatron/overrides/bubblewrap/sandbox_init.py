"""The code sandbox's own init (pid 1 of its pid namespace) in place of bubblewrap's.

bubblewrap's init (bubblewrap.c ``do_init``, unchanged from 0.8.0 to 0.11.1) reports the command's exit status to
bwrap's outer process through an eventfd, and the outer process exits as soon as it reads it, before the init
itself has exited: the init is left an orphan. Its new parent is the nearest child subreaper or PID 1, and where
that does not reap (a trainer that is a child subreaper, a container's PID 1 that is not an init, as on this CI
machine), every call leaves a zombie ``bwrap`` until the pids run out (issue 41, item 4).

With :data:`OPTIONS` (``--as-pid-1``) bubblewrap starts no init of its own and its outer process waits for the
command itself; :func:`with_own_init` makes that command a shell that runs the real one as its child, reaps the
orphans of the code while it waits (as bubblewrap's init did) and exits with the child's status (``128 + n`` for
signal ``n``, as bubblewrap reports it). Its own messages ("Killed") go to /dev/null; the child keeps stderr.
"""

from __future__ import annotations

OPTIONS = ("--as-pid-1",)
SHELL = "/bin/sh"
INIT_SCRIPT = 'exec 3>&2 2>/dev/null; "$@" 2>&3 3>&-; exit $?'


def with_own_init(command: list[str]) -> list[str]:
    """``command`` run under the sandbox's own init: what follows ``--`` on bubblewrap's command line."""
    return [SHELL, "-c", INIT_SCRIPT, "sandbox-init", *command]
