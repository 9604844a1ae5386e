"""Where each process of a SLURM job goes: the node split, ports and server URLs for the sbatch scripts.

The two sbatch scripts in this folder keep their shell small and ask this module (standard library only, so any
``python3`` on the nodes can run it) for everything that needs arithmetic:

* ``plan``          — split the job's nodes into SGLang server nodes and trainer nodes and print shell assignments
                      (``eval "$(python3 launch_plan.py plan ...)"``).
* ``serve``         — run inside each task of the server step: pick this task's port, GPUs and gloo interface
                      (the one that reaches ``MASTER_ADDR``), read the API key file and ``exec`` the SGLang server.
* ``wait-healthy``  — poll every server's ``/health`` until all answer 200, the server step exits, or a deadline.
* ``server-settings`` — what the servers take from the trainer's resolved config (loaded here, so a bad config fails
                      before any server is started): the model (``model.hf_path``), the dtype (from
                      ``model.precision``, as for servers the engine launches) and whether NCCL carries the weights
                      (``transport = distributed`` on GPU nodes: then ``NCCL_CUMEM_ENABLE=0`` on both ends).
* ``new-api-key``   — a fresh random key for the servers, in a file created with mode 0600.

The layout (N nodes in the job, M = ``sglang_nodes``, G GPUs per node, T = SGLang TP per server):

* N > M: nodes[0:M] serve, nodes[M:] train. Each server node runs S = G // T servers (1 on CPU nodes), on ports
  ``base, base+1, ..., base+S-1``; server task with local id i uses GPUs [i·T, (i+1)·T). The trainer runs one task
  per GPU on each of its N - M nodes (``tasks_per_node`` tasks on CPU nodes).
* N = M = 1: one node does both (a single-node test cluster, or a small GPU box): S servers take the first S·T GPUs
  and the trainer the remaining G - S·T, through ``CUDA_VISIBLE_DEVICES`` (on CPU nodes the trainer keeps its
  ``tasks_per_node`` tasks and the servers share the CPUs).
* M = 0: no servers; all N nodes train (the plain ``dapo_train.sbatch``).

Nodes are addressed by their SLURM ``NodeAddr`` (``plan --resolve-addrs`` asks ``scontrol``): the trainer's
``MASTER_ADDR`` and the server URLs must reach the node even where its name does not resolve (or resolves to a
loopback address). ``NodeAddr`` defaults to the node name, so on clusters with DNS nothing changes.

Ports are derived from the job id so that two jobs sharing a node do not collide, and stay below Linux's ephemeral
range (32768-60999) so a client socket cannot hold them: ``MASTER_PORT = 20000 + job_id mod 10000``,
server base port ``= 10000 + (job_id mod ⌊10000 / S⌋) · S`` (consecutive jobs get disjoint port blocks).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000
SERVER_PORT_BASE = 10000
SERVER_PORT_SPAN = 10000


class PlanError(ValueError):
    """The requested layout does not fit the allocation; the message names the numbers."""


@dataclass(frozen=True)
class LaunchPlan:
    server_hosts: list[str]
    servers_per_node: int
    server_base_port: int
    server_tp: int
    gpus_per_node: int
    trainer_hosts: list[str]
    trainer_tasks_per_node: int
    trainer_cuda_visible_devices: str  # "" = leave as SLURM set it
    master_addr: str
    master_port: int
    node_addrs: Mapping[str, str] = field(default_factory=dict)  # host -> NodeAddr; a missing host is its name

    def address(self, host: str) -> str:
        return self.node_addrs.get(host, host)

    @property
    def server_urls(self) -> list[str]:
        return [f"http://{self.address(host)}:{self.server_base_port + i}"
                for host in self.server_hosts for i in range(self.servers_per_node)]

    @property
    def trainer_world_size(self) -> int:
        return len(self.trainer_hosts) * self.trainer_tasks_per_node

    def shell_assignments(self) -> str:
        """``KEY=value`` lines, shell-quoted, for ``eval`` in the sbatch scripts."""
        values = {
            "SERVER_NODES": ",".join(self.server_hosts),
            "SERVER_NNODES": len(self.server_hosts),
            "SERVERS_PER_NODE": self.servers_per_node,
            "SERVER_NTASKS": len(self.server_hosts) * self.servers_per_node,
            "SERVER_BASE_PORT": self.server_base_port,
            "SERVER_URLS": json.dumps(self.server_urls, separators=(",", ":")),
            "NODE_GPUS": self.gpus_per_node,
            "TRAINER_NODES": ",".join(self.trainer_hosts),
            "TRAINER_NNODES": len(self.trainer_hosts),
            "TRAINER_TASKS_PER_NODE": self.trainer_tasks_per_node,
            "TRAINER_NTASKS": self.trainer_world_size,
            "TRAINER_CUDA_VISIBLE_DEVICES": self.trainer_cuda_visible_devices,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": self.master_port,
        }
        return "".join(f"{key}={shlex.quote(str(value))}\n" for key, value in values.items())


def master_port(job_id: int) -> int:
    return MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN


def server_base_port(job_id: int, servers_per_node: int) -> int:
    block = max(servers_per_node, 1)
    return SERVER_PORT_BASE + (job_id % (SERVER_PORT_SPAN // block)) * block


def parse_gpu_count(text: str | None) -> int:
    """GPUs per node from ``--gpus-per-node`` / ``SLURM_GPUS_PER_NODE`` forms: ``8``, ``gpu:8``, ``h100:8``, ``""``."""
    if text is None or not text.strip():
        return 0
    match = re.fullmatch(r"(?:[A-Za-z0-9_\-]+:)?(\d+)", text.strip())
    if not match:
        raise PlanError(f"cannot read a GPU count from {text!r} (expected N or type:N)")
    return int(match.group(1))


def parse_tasks_per_node(text: str | None) -> int:
    """``SLURM_NTASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` forms: ``8``, ``8(x16)``, ``8(x2),4`` (first count)."""
    if text is None or not text.strip():
        return 1
    try:
        return _project_module("dapo_megatron.slurm_tasks").tasks_on_each_node(text)[0]
    except ValueError as error:
        raise PlanError(f"cannot read a task count: {error}") from None


def node_addresses(hosts: list[str], timeout_s: float = 30.0) -> dict[str, str]:
    """Each host's ``NodeAddr`` from ``scontrol show node`` (run inside the job, where the controller answers)."""
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", ",".join(hosts)], capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise PlanError(f"cannot ask scontrol for the nodes' addresses: {error}") from None
    found = {}
    for line in out.stdout.splitlines():
        fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
        if "NodeName" in fields and fields.get("NodeAddr"):
            found[fields["NodeName"]] = fields["NodeAddr"]
    missing = [host for host in hosts if host not in found]
    if missing:
        raise PlanError(f"scontrol reports no NodeAddr for {', '.join(missing)}: {out.stderr.strip()}")
    return found


def make_plan(hosts: list[str], *, sglang_nodes: int, gpus_per_node: int, tasks_per_node: int, job_id: int,
              server_tp: int = 1, servers_per_node: int | None = None,
              node_addrs: Mapping[str, str] | None = None) -> LaunchPlan:
    """Split ``hosts`` (the job's nodes, in SLURM order) into server and trainer nodes; see the module docstring.
    ``node_addrs``: how to reach each host (its NodeAddr) where that is not its name."""
    node_addrs = dict(node_addrs or {})

    def address(host: str) -> str:
        return node_addrs.get(host, host)

    n = len(hosts)
    if n == 0:
        raise PlanError("the job has no nodes")
    if len(set(hosts)) != n:
        raise PlanError(f"the node list repeats a host: {hosts}")
    if sglang_nodes < 0:
        raise PlanError(f"sglang_nodes must be >= 0, got {sglang_nodes}")
    if server_tp < 1:
        raise PlanError(f"the SGLang TP per server must be >= 1, got {server_tp}")
    if gpus_per_node < 0 or tasks_per_node < 1:
        raise PlanError(f"gpus_per_node ({gpus_per_node}) must be >= 0 and tasks_per_node ({tasks_per_node}) >= 1")
    trainer_tasks = gpus_per_node if gpus_per_node else tasks_per_node  # one trainer rank per GPU

    if sglang_nodes == 0:
        return LaunchPlan([], 0, server_base_port(job_id, 1), server_tp, gpus_per_node, list(hosts), trainer_tasks,
                          "", address(hosts[0]), master_port(job_id), node_addrs)

    single_node = n == 1 and sglang_nodes == 1
    if not single_node and sglang_nodes >= n:
        raise PlanError(f"SGLANG_NODES={sglang_nodes} leaves no node for the trainer in a job of {n} node(s) "
                        f"(ask for more nodes, or use 1 node for both)")
    if gpus_per_node and server_tp > gpus_per_node:
        raise PlanError(f"SGLang TP per server ({server_tp}) is more than the {gpus_per_node} GPUs of a node")

    if servers_per_node is None:
        servers_per_node = 1 if (single_node or not gpus_per_node) else gpus_per_node // server_tp
    if servers_per_node < 1:
        raise PlanError(f"servers_per_node must be >= 1, got {servers_per_node}")
    server_gpus = servers_per_node * server_tp
    if gpus_per_node and server_gpus > gpus_per_node:
        raise PlanError(f"{servers_per_node} server(s) × TP {server_tp} = {server_gpus} GPUs do not fit a node of "
                        f"{gpus_per_node} GPUs")

    cuda_devices = ""
    if single_node:
        server_hosts, trainer_hosts = list(hosts), list(hosts)
        if gpus_per_node:
            if server_gpus >= gpus_per_node:
                raise PlanError(f"on one node, {servers_per_node} server(s) × TP {server_tp} = {server_gpus} GPUs "
                                f"leave none of the {gpus_per_node} GPUs for the trainer")
            trainer_tasks = gpus_per_node - server_gpus
            cuda_devices = ",".join(str(g) for g in range(server_gpus, gpus_per_node))
    else:
        server_hosts, trainer_hosts = list(hosts[:sglang_nodes]), list(hosts[sglang_nodes:])
    return LaunchPlan(server_hosts, servers_per_node, server_base_port(job_id, servers_per_node), server_tp,
                      gpus_per_node, trainer_hosts, trainer_tasks, cuda_devices, address(trainer_hosts[0]),
                      master_port(job_id), node_addrs)


# --------------------------------------------------------------------------------------------------- serve


def server_gpu_slice(local_id: int, server_tp: int, visible: str | None, gpus_per_node: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` for server task ``local_id``: its T devices out of what SLURM made visible
    (or 0..G-1 when SLURM set nothing). Empty on CPU nodes."""
    if not gpus_per_node:
        return ""
    devices = [d for d in (visible or "").split(",") if d] or [str(g) for g in range(gpus_per_node)]
    start = local_id * server_tp
    if start + server_tp > len(devices):
        raise PlanError(f"server task {local_id} needs devices [{start}, {start + server_tp}) but only "
                        f"{len(devices)} are visible ({','.join(devices)})")
    return ",".join(devices[start:start + server_tp])


def write_api_key(path: str) -> None:
    """A fresh 256-bit key in ``path``, mode 0600 from the moment the file exists (an old file is replaced).
    Hex digits only: a key starting with ``-`` would be read as an option by the server's argument parser."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32) + "\n")
    os.replace(tmp, target)


def read_api_key(path: str) -> str:
    key = Path(path).read_text().strip()
    if not key:
        raise PlanError(f"API key file {path} is empty")
    return key


def server_argv(server_cmd: str, *, model_path: str, host: str, port: int, api_key: str, tp: int,
                dtype: str | None = None, extra_args: str = "") -> list[str]:
    """The server's command line; ``--dtype`` in ``extra_args`` wins over ``dtype``."""
    extra = shlex.split(extra_args)
    dtype_args = ["--dtype", dtype] if dtype and not any(a == "--dtype" or a.startswith("--dtype=") for a in extra) \
        else []
    return [*shlex.split(server_cmd), "--model-path", model_path, "--host", host, "--port", str(port),
            f"--api-key={api_key}", "--tp", str(tp), *dtype_args, *extra]


def _project_module(name: str):
    """A module of the project this script belongs to (the repository root is this folder's parent), the same
    code the trainer step runs with ``python -m`` from the repository root."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(name)


def _serve(args: argparse.Namespace) -> None:
    local_id = int(os.environ.get("SLURM_LOCALID", "0"))
    env = dict(os.environ)
    devices = server_gpu_slice(local_id, args.tp, env.get("CUDA_VISIBLE_DEVICES"), args.gpus_per_node)
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = devices
    # The distributed weight transport joins the server to a gloo group hosted by the trainer (MASTER_ADDR's node):
    # gloo must listen on the interface that reaches it, not on whatever this node's name resolves to.
    gloo_interface = None
    if env.get("MASTER_ADDR"):
        gloo_interface = _project_module("dapo_megatron.host_address").pin_gloo_interface(env["MASTER_ADDR"], env)
    if args.nccl_weight_sync:
        env.update(_project_module("dapo_megatron.rollout.sglang.gpus").NCCL_CUMEM_OFF)
    port = args.base_port + local_id
    argv = server_argv(args.server_cmd, model_path=args.model_path, host=args.bind_host, port=port,
                       api_key=read_api_key(args.api_key_file), tp=args.tp, dtype=args.dtype,
                       extra_args=args.extra_args)
    print(f"[launch_plan] server task {local_id} on {os.uname().nodename}: port {port}"
          + (f", CUDA_VISIBLE_DEVICES={devices}" if devices else "")
          + (f", GLOO_SOCKET_IFNAME={gloo_interface}" if gloo_interface else ""), flush=True)
    os.execvpe(argv[0], argv, env)


# --------------------------------------------------------------------------------------------------- health


def _healthy(url: str, api_key: str, timeout_s: float) -> bool:
    request = urllib.request.Request(f"{url}/health", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by the shell that waits for it) still answers kill(0).
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def wait_healthy(urls: list[str], api_key: str, *, deadline_s: float, watch_pid: int | None = None,
                 poll_s: float = 2.0) -> list[str]:
    """Poll ``GET url/health`` until every URL answers 200. Returns the URLs still unhealthy (empty = success)
    when the deadline passes or the process ``watch_pid`` (the server step's srun) has exited."""
    pending = list(urls)
    end = time.monotonic() + deadline_s
    while pending:
        pending = [url for url in pending if not _healthy(url, api_key, timeout_s=min(poll_s, 5.0))]
        if not pending:
            break
        if watch_pid is not None and not _pid_running(watch_pid):
            print(f"[launch_plan] the server step (pid {watch_pid}) exited before "
                  f"{len(pending)} server(s) became healthy", file=sys.stderr)
            return pending
        if time.monotonic() >= end:
            print(f"[launch_plan] {len(pending)} of {len(urls)} server(s) not healthy after {deadline_s:.0f} s: "
                  f"{', '.join(pending)}", file=sys.stderr)
            return pending
        time.sleep(poll_s)
    return []


# --------------------------------------------------------------------------------------------------- server settings


def server_settings_from_config(config_path: str, overrides: list[str], *, gpus_per_node: int) -> dict[str, str]:
    """``MODEL_PATH``, ``SERVER_DTYPE`` and ``SERVER_NCCL_WEIGHT_SYNC`` (1/0) for the servers of this config."""
    config = load_trainer_config(config_path, overrides)
    if config.model.source != "hf" or not config.model.hf_path:
        raise PlanError(f"{config_path}: SGLang servers load an HF folder, so the config needs model.source = hf "
                        f"and model.hf_path (got source={config.model.source!r}); or set SGLANG_MODEL_PATH")
    served_dtype = _project_module("dapo_megatron.rollout.sglang.server").served_dtype
    nccl = _project_module("dapo_megatron.rollout.sglang.gpus").nccl_carries_weights(
        config.rollout.sglang.transport, "cuda" if gpus_per_node else "cpu")
    return {"MODEL_PATH": config.model.hf_path, "SERVER_DTYPE": served_dtype(config.model.precision),
            "SERVER_NCCL_WEIGHT_SYNC": str(int(nccl))}


def load_trainer_config(config_path: str, overrides: list[str]):
    """The trainer's resolved config (the trainer's interpreter only: needs the project and pyyaml)."""
    return _project_module("dapo_megatron.config").load_config(config_path, overrides)


# --------------------------------------------------------------------------------------------------- CLI


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the node split as shell assignments")
    plan.add_argument("--hosts", required=True, help="the job's hosts, comma-separated, in SLURM order")
    plan.add_argument("--job-id", type=int, required=True)
    plan.add_argument("--sglang-nodes", type=int, default=0)
    plan.add_argument("--gpus-per-node", default="", help="N or type:N; empty/0 = CPU nodes")
    plan.add_argument("--tasks-per-node", default="", help="trainer tasks per node on CPU nodes (SLURM forms)")
    plan.add_argument("--server-tp", type=int, default=1)
    plan.add_argument("--servers-per-node", type=int, default=None)
    plan.add_argument("--resolve-addrs", action="store_true",
                      help="address nodes by their NodeAddr from scontrol (inside a job)")

    serve = sub.add_parser("serve", help="exec this task's SGLang server (inside the server srun step)")
    serve.add_argument("--server-cmd", required=True, help="e.g. 'python -m sglang.launch_server'")
    serve.add_argument("--model-path", required=True)
    serve.add_argument("--api-key-file", required=True)
    serve.add_argument("--base-port", type=int, required=True)
    serve.add_argument("--tp", type=int, default=1)
    serve.add_argument("--gpus-per-node", type=int, default=0)
    serve.add_argument("--bind-host", default="0.0.0.0")
    serve.add_argument("--dtype", default=None, help="SGLang's --dtype (server-settings' SERVER_DTYPE)")
    serve.add_argument("--nccl-weight-sync", action="store_true",
                       help="NCCL carries the weights (transport=distributed on GPUs): NCCL_CUMEM_ENABLE=0")
    serve.add_argument("--extra-args", default="", help="appended to the server command line")

    health = sub.add_parser("wait-healthy", help="wait until every server answers /health")
    health.add_argument("--urls", required=True, help="JSON list of server URLs")
    health.add_argument("--api-key-file", required=True)
    health.add_argument("--deadline-s", type=float, required=True)
    health.add_argument("--watch-pid", type=int, default=None, help="fail early when this process exits")

    settings = sub.add_parser("server-settings", help="print MODEL_PATH, SERVER_DTYPE, SERVER_NCCL_WEIGHT_SYNC "
                                                      "of the resolved trainer config as shell assignments")
    settings.add_argument("--gpus-per-node", default=None, help="N or type:N, as SLURM gives it (empty: CPU nodes)")
    settings.add_argument("config")
    settings.add_argument("overrides", nargs=argparse.REMAINDER,
                          help="the trainer's arguments after CONFIG; its flags (--resume) are skipped")

    key = sub.add_parser("new-api-key", help="write a fresh random API key to FILE, readable by its owner only")
    key.add_argument("file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            hosts = [h for h in args.hosts.split(",") if h]
            plan = make_plan(hosts, sglang_nodes=args.sglang_nodes, job_id=args.job_id,
                             node_addrs=node_addresses(hosts) if args.resolve_addrs else None,
                             gpus_per_node=parse_gpu_count(args.gpus_per_node),
                             tasks_per_node=parse_tasks_per_node(args.tasks_per_node),
                             server_tp=args.server_tp, servers_per_node=args.servers_per_node)
            sys.stdout.write(plan.shell_assignments())
        elif args.command == "serve":
            _serve(args)
        elif args.command == "wait-healthy":
            urls = json.loads(args.urls)
            return 1 if wait_healthy(urls, read_api_key(args.api_key_file), deadline_s=args.deadline_s,
                                     watch_pid=args.watch_pid) else 0
        elif args.command == "server-settings":
            settings = server_settings_from_config(args.config, [a for a in args.overrides if not a.startswith("--")],
                                                   gpus_per_node=parse_gpu_count(args.gpus_per_node))
            sys.stdout.write("".join(f"{key}={shlex.quote(value)}\n" for key, value in settings.items()))
        elif args.command == "new-api-key":
            write_api_key(args.file)
    except (PlanError, OSError) as exc:
        print(f"[launch_plan] error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # dapo_megatron.config.ConfigError is a ValueError
        print(f"[launch_plan] error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
