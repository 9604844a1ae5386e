"""Submitting real jobs to the test cluster (``scripts/slurm_cluster.sh``) and inspecting what they leave behind.

* :func:`cluster_unavailable` — why the SLURM tests cannot run here (None when they can);
* :func:`start_job` / :func:`submit` — ``sbatch --wait`` in the background / to the end, under a deadline;
* :func:`node_namespaces` / :func:`processes_on_nodes` — every node's processes: the namespace nodes of the
  multi-node layout share this machine's PID space, so /proc shows them all, and a process's network namespace says
  which node it runs on;
* :func:`assert_nothing_left` — no process of a job on any node, and nothing but slurmd in a node's namespace.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM_RUN_DIR = Path("/run/slurm")  # where scripts/slurm_cluster.sh keeps the daemons' PID files
# The SGLang interpreter (it may be a separate environment); defaults to this one.
SGLANG_PYTHON = os.environ.get("DAPO_SGLANG_PYTHON", sys.executable)


def cluster_unavailable(min_nodes: int = 1) -> str | None:
    """Why the SLURM tests cannot run here, or None when a cluster of at least ``min_nodes`` idle nodes is up."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH (start a test cluster: scripts/slurm_cluster.sh start)"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 15 s: the SLURM controller is not up (scripts/slurm_cluster.sh start)"
    usable = {line.split()[0] for line in out.stdout.splitlines() if line.split()[1:] in (["idle"], ["mix"], ["alloc"])}
    if out.returncode or not usable:
        return f"the SLURM cluster is not up (sinfo: {out.stdout.strip() or out.stderr.strip()!r})"
    if len(usable) < min_nodes:
        return (f"the SLURM cluster has {len(usable)} usable node(s), these tests need {min_nodes} "
                f"(scripts/slurm_cluster.sh start --nodes {min_nodes})")
    return None


def job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, DAPO_PYTHON=sys.executable, DAPO_SHARED_DIR=str(tmp_path), OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def sglang_unavailable(python: str = SGLANG_PYTHON) -> str | None:
    """Why a real SGLang server cannot be started by the test jobs, or None."""
    try:
        result = subprocess.run([python, "-c", "import sglang"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot run the SGLang interpreter {python}: {error}"
    if result.returncode:
        return f"SGLang is not importable by {python} (scripts/install_sglang_cpu.sh): {result.stderr.strip()[-300:]}"
    return None


def sglang_job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """:func:`job_env` for jobs whose servers are real SGLang servers on CPU: the CPU engine, the ``sgl_kernel``
    stand-in on the servers' path, fp32 (HF's greedy output is the reference) and a small KV cache."""
    from dapo_megatron.cpu.sglang import server_pythonpath

    why = sglang_unavailable()
    if why is not None:
        pytest.skip(why)
    env = job_env(tmp_path, SGLANG_PYTHON=SGLANG_PYTHON, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1",
                  TRANSFORMERS_OFFLINE="1", PYTHONPATH=f"{server_pythonpath()}:{REPO}",
                  SGLANG_EXTRA_ARGS="--device cpu --max-total-tokens 4096 --sleep-on-idle --dtype float32")
    env.update(extra)
    return env


@dataclass
class Job:
    job_id: str
    returncode: int
    output: str
    seconds: float


class RunningJob:
    """``sbatch --wait`` in the background; :meth:`wait` collects it (cancelling it at the deadline)."""

    def __init__(self, args: list[str], tmp_path: Path, env: dict[str, str]):
        self.out_pattern = str(tmp_path / "job-%j.out")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(["sbatch", "--wait", "--parsable", f"--output={self.out_pattern}", *args],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.job_id = self.proc.stdout.readline().strip().split(";")[0]
        if not self.job_id.isdigit():
            self.proc.wait(timeout=60)
            pytest.fail(f"sbatch did not submit: {self.proc.stderr.read()}")

    @property
    def output_path(self) -> Path:
        return Path(self.out_pattern.replace("%j", self.job_id))

    def output(self) -> str:
        return self.output_path.read_text() if self.output_path.exists() else ""

    def running(self) -> bool:
        return self.proc.poll() is None

    def cancel(self) -> None:
        subprocess.run(["scancel", self.job_id], check=False, timeout=60)

    def wait(self, deadline_s: float) -> Job:
        try:
            self.proc.wait(timeout=max(deadline_s - (time.monotonic() - self.started), 1.0))
        except subprocess.TimeoutExpired:
            self.cancel()
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"job {self.job_id} still running after {deadline_s:.0f} s (cancelled); output:\n"
                        f"{self.output()[-4000:]}")
        seconds = time.monotonic() - self.started
        print(f"job {self.job_id}: exit {self.proc.returncode} in {seconds:.1f} s")
        return Job(self.job_id, self.proc.returncode, self.output(), seconds)

    def start_again_once_requeued(self, deadline_s: float) -> None:
        """Wait until the job is PENDING again with a restart counted (requeued; a job waiting for its first start
        is PENDING too), then start it instead of the ~2 minutes SLURM holds a requeued job. Not in the second of
        the requeue: slurmd refuses that start ("Killing non-startable batch JobId=147: Job credential revoked" in
        slurmctld.log; the job ends FAILED with exit 1), which failed this test in CI. Not with a later StartTime
        either: the update's own scheduling pass finds the job not yet eligible, and the next waits ~60 s."""
        while (fields := job_fields(self.job_id)).get("JobState") != "PENDING" or fields.get("Restarts") == "0":
            assert fields and time.monotonic() - self.started < deadline_s, \
                f"job {self.job_id}: {fields.get('JobState')}, not requeued\n{self.output()[-3000:]}"
            time.sleep(0.5)
        time.sleep(2.0)
        subprocess.run(["scontrol", "update", f"JobId={self.job_id}", "StartTime=now"], check=True, timeout=60)


def start_job(args: list[str], tmp_path: Path, env: dict[str, str]) -> RunningJob:
    return RunningJob(args, tmp_path, env)


def job_fields(job_id: str) -> dict[str, str]:
    """``scontrol show job -o``'s KEY=VALUE fields (empty once slurmctld has purged the job)."""
    result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    if result.returncode:
        return {}
    return dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)


def submit(args: list[str], tmp_path: Path, env: dict[str, str], deadline_s: float) -> Job:
    """``sbatch --wait`` to the end; returns the job's exit code and its output file."""
    return start_job(args, tmp_path, env).wait(deadline_s)


# ----------------------------------------------------------------------------------------------------- processes


def _net_namespace(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def node_namespaces() -> dict[str, tuple[int, str]]:
    """node name -> (slurmd pid, network namespace) for the namespace nodes of the multi-node layout (empty for the
    single-node layout, whose node is this machine's root namespace)."""
    nodes = {}
    for pidfile in sorted(SLURM_RUN_DIR.glob("slurmd-*.pid")):
        pid = int(pidfile.read_text().strip())
        namespace = _net_namespace(pid)
        if namespace is not None and namespace != _net_namespace(os.getpid()):
            nodes[pidfile.stem.removeprefix("slurmd-")] = (pid, namespace)
    return nodes


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def processes_on_nodes() -> dict[str, list[tuple[int, str]]]:
    """node -> [(pid, command line)] of every process in the node's network namespace except its slurmd."""
    nodes = node_namespaces()
    by_namespace = {namespace: name for name, (_, namespace) in nodes.items()}
    slurmds = {pid for pid, _ in nodes.values()}
    found: dict[str, list[tuple[int, str]]] = {name: [] for name in nodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in slurmds:
            continue
        node = by_namespace.get(_net_namespace(proc.name))
        if node is not None:
            found[node].append((int(proc.name), _cmdline(proc.name)[:200]))
    return found


def processes_of_job(job_id: str) -> list[str]:
    """Processes anywhere on this machine (any node) whose environment says they belong to the job."""
    found = []
    marker = f"SLURM_JOB_ID={job_id}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(f"{proc.name}: {_cmdline(proc.name)[:200]}")
        except OSError:
            continue  # exited meanwhile, or not readable
    return found


def assert_nothing_left(job_id: str, grace_s: float = 30.0) -> None:
    """Within ``grace_s`` (SLURM's own step cleanup is asynchronous): no process of the job on any node, and no
    process at all besides slurmd in any node's namespace (an orphan that lost the job's environment included)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = processes_of_job(job_id)
        strays = {node: procs for node, procs in processes_on_nodes().items() if procs}
        if not left and not strays:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"left behind by job {job_id} after {grace_s:.0f} s: processes of the job {left}; "
                        f"processes on the nodes besides slurmd {strays}")
        time.sleep(0.5)


def rendezvous_line(output: str) -> re.Match | None:
    """The sbatch scripts' ``N trainer ranks on NODES (...), rendezvous ADDR:PORT`` line."""
    return re.search(r"(\d+) trainer ranks on (\S+?),? .*?rendezvous (\S+):(\d+)", output)
