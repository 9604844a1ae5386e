"""Where this process sits in the launch, from the launcher's variables alone (no torch: a config error or a bad
launch is reported before torch and megatron-core load).

:func:`launch_env` — rank, world size, local rank and rendezvous address from torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, first host of
SLURM_JOB_NODELIST); a plain ``python`` launch is a world of one. Which restart of the job this is comes from the
launcher too: torchrun's TORCHELASTIC_RESTART_COUNT (``--max-restarts``), SLURM's SLURM_RESTART_COUNT (a requeued
job). :func:`local_world_size` — the trainer ranks on
this node. :func:`expand_nodelist` — a SLURM host list as host names.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import Mapping

from dapo_megatron.slurm_tasks import tasks_on_each_node
from dapo_megatron.user_errors import UserError

DEFAULT_MASTER_PORT = 29500


class LaunchError(UserError, RuntimeError, kind="launch"):
    """The process layout or rendezvous is wrong (world size, ports, missing variables)."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"
    restart_count: int = 0  # how many times the launcher restarted the job before this start


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list (``node[01-04]``, ``a1,b2``, ``gpu-[1,3-5]``) into host names.

    Uses ``scontrol show hostnames`` when it is installed (it knows every form SLURM accepts), else a parser for
    the bracket forms above, including several bracket groups and zero-padded ranges.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise LaunchError("SLURM_JOB_NODELIST is empty")
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10, check=True
            ).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass  # fall back to our own parser
    return parse_nodelist(nodelist)


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_host_pattern(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    hosts = []
    for item in match.group(1).split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise LaunchError(f"bad range {item!r} in SLURM host list {pattern!r}")
            width = len(lo)
            numbers = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        else:
            numbers = [item]
        for number in numbers:
            hosts.extend(_expand_host_pattern(head + number + tail))
    return hosts


def parse_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list (``n[1-3,5]-ib,x``) expanded without ``scontrol``: what
    :func:`expand_nodelist` falls back to."""
    if nodelist.count("[") != nodelist.count("]"):
        raise LaunchError(f"unbalanced brackets in SLURM host list {nodelist!r}")
    hosts = []
    for part in _split_top_level(nodelist):
        hosts.extend(_expand_host_pattern(part))
    return hosts


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """Trainer ranks on this node: torchrun's ``LOCAL_WORLD_SIZE``, SLURM's tasks on this node, else 1."""
    env = os.environ if environ is None else environ
    if "LOCAL_WORLD_SIZE" in env:
        return int(env["LOCAL_WORLD_SIZE"])
    if "SLURM_NTASKS_PER_NODE" in env:
        return int(env["SLURM_NTASKS_PER_NODE"])
    if "SLURM_TASKS_PER_NODE" in env:  # e.g. "4(x2),3": 4 tasks on each of the first two nodes, 3 on the third
        try:
            per_node = tasks_on_each_node(env["SLURM_TASKS_PER_NODE"])
        except ValueError as error:
            raise ValueError(f"SLURM_TASKS_PER_NODE: {error}") from None
        return per_node[int(env.get("SLURM_NODEID", 0))]
    return 1


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the process layout from torchrun variables, else SLURM variables, else a single process."""
    env = os.environ if environ is None else environ
    port = int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT))
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=port,
            launcher="torchrun",
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        missing = [k for k in ("SLURM_LOCALID", "SLURM_JOB_NODELIST") if k not in env]
        if missing:
            raise LaunchError(f"SLURM launch is missing {', '.join(missing)} (are you inside srun?)")
        master = env.get("MASTER_ADDR") or expand_nodelist(env["SLURM_JOB_NODELIST"])[0]
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env["SLURM_LOCALID"]),
            master_addr=master,
            master_port=port,
            launcher="slurm",
            restart_count=int(env.get("SLURM_RESTART_COUNT", 0)),
        )
    # A world of one rendezvous with itself: any free port will do unless the user chose one.
    return LaunchEnv(0, 1, 0, "127.0.0.1", port if "MASTER_PORT" in env else free_port(), "single")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
