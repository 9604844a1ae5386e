"""Real SLURM jobs on a running cluster (CI starts one with ``scripts/slurm_cluster.sh start``; CPU only).

(a) ``srun`` with 2 tasks: what ``platform.launch_env()`` sees in each task.
(b) ``slurm/dapo_train_sglang.sbatch`` whose trainer fails after the servers are up: the failure's exit code comes
    back through ``sbatch --wait``, the script itself stops the server step and no process of the job is left.
    A real SGLang server is used when the server interpreter can ``import sglang`` and the repository has SGLang's
    CPU kernel stand-in; otherwise a stand-in HTTP server with SGLang's arguments and ``/health``.
    A config with an unknown key fails before any server starts.
(c) ``slurm/dapo_train.sbatch`` on ``examples/tiny_cpu.yaml`` with 2 tasks (DP = 2, and TP = 2): exit 0 and a run
    directory with TensorBoard events, metrics.jsonl and a checkpoint.

Each job runs with a time limit and the test with a deadline; a job still running at the deadline is cancelled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_CPU_CONFIG = REPO / "examples" / "tiny_cpu.yaml"
# The SGLang interpreter (it may be a separate environment); defaults to this one.
SGLANG_PYTHON = os.environ.get("DAPO_SGLANG_PYTHON", sys.executable)
# Resources every test job asks for: this cluster's node has no GPUs and 2 CPUs.
CPU_JOB = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=10"]


def _cluster_state() -> str | None:
    """Why the SLURM tests cannot run here, or None when they can."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH (start a test cluster: scripts/slurm_cluster.sh start)"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 15 s: the SLURM controller is not up (scripts/slurm_cluster.sh start)"
    states = out.stdout.split()
    if out.returncode or not any(s in ("idle", "mix", "alloc") for s in states):
        return f"the SLURM cluster is not up (sinfo: {out.stdout.strip() or out.stderr.strip()!r})"
    return None


_why_not = _cluster_state()
pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.skipif(_why_not is not None, reason=_why_not or "")]


def _job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, DAPO_PYTHON=sys.executable, DAPO_SHARED_DIR=str(tmp_path), OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


class Job:
    def __init__(self, job_id: str, returncode: int, output: str, seconds: float):
        self.job_id, self.returncode, self.output, self.seconds = job_id, returncode, output, seconds


def submit(args: list[str], tmp_path: Path, env: dict[str, str], deadline_s: float) -> Job:
    """``sbatch --wait``; returns the job's exit code and its output file. Cancels the job at the deadline."""
    out_file = tmp_path / "job-%j.out"
    t0 = time.monotonic()
    proc = subprocess.Popen(["sbatch", "--wait", "--parsable", f"--output={out_file}", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = proc.stdout.readline().strip().split(";")[0]
    try:
        proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        if job_id:
            subprocess.run(["scancel", job_id], check=False)
        proc.kill()
        proc.wait()
        text = Path(str(out_file).replace("%j", job_id)).read_text() if job_id else ""
        pytest.fail(f"job {job_id} still running after {deadline_s:.0f} s (cancelled); output:\n{text[-4000:]}")
    seconds = time.monotonic() - t0
    assert job_id.isdigit(), f"sbatch did not submit: {proc.stderr.read()}"
    output = Path(str(out_file).replace("%j", job_id)).read_text()
    print(f"job {job_id}: exit {proc.returncode} in {seconds:.1f} s")
    return Job(job_id, proc.returncode, output, seconds)


def processes_of_job(job_id: str) -> list[str]:
    """Processes on this node whose environment says they belong to the job (SLURM_JOB_ID=<id>)."""
    found = []
    marker = f"SLURM_JOB_ID={job_id}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name}: {cmdline[:200]}")
        except OSError:
            continue  # exited meanwhile, or not readable
    return found


# ------------------------------------------------------------------------------------------------------- (a)


def test_srun_two_tasks_see_their_ranks(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""\
        import dataclasses, json, socket
        from dapo_megatron.platform import launch_env
        print("LAUNCH_ENV " + json.dumps(dict(dataclasses.asdict(launch_env()), host=socket.gethostname())))
    """))
    job = submit([*CPU_JOB, "--wrap", f"srun --ntasks=2 {sys.executable} {probe}"], tmp_path, _job_env(tmp_path),
                 deadline_s=180)
    assert job.returncode == 0, job.output
    seen = [json.loads(line.split(" ", 1)[1]) for line in job.output.splitlines() if line.startswith("LAUNCH_ENV ")]
    assert sorted(s["rank"] for s in seen) == [0, 1], job.output
    assert {s["world_size"] for s in seen} == {2}
    assert sorted(s["local_rank"] for s in seen) == [0, 1]  # one node: local rank = rank
    assert {s["launcher"] for s in seen} == {"slurm"}
    masters = {s["master_addr"] for s in seen}
    assert len(masters) == 1
    first_node = subprocess.run(["scontrol", "show", "hostnames", seen[0]["host"]], capture_output=True,
                                text=True).stdout.split()[0]
    assert masters == {first_node}


# ------------------------------------------------------------------------------------------------------- (b)

STAND_IN_SERVER = '''\
"""A stand-in for `python -m sglang.launch_server` (used only when SGLang is not installed): the same arguments,
/health, and the API key required on everything else."""
import argparse, http.server, os, sys, threading

parser = argparse.ArgumentParser()
for flag in ("--model-path", "--host", "--port", "--api-key", "--tp"):
    parser.add_argument(flag, required=True)
parser.add_argument("--die-after-s", type=float, default=None)  # to play a server node that fails mid-run
args, unknown = parser.parse_known_args()
if args.die_after_s is not None:
    threading.Timer(args.die_after_s, lambda: (print("stand-in server: dying", flush=True), os._exit(137))).start()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        authorized = self.headers.get("Authorization") == "Bearer " + args.api_key
        self.send_response(200 if self.path == "/health" or authorized else 401)
        self.end_headers()

    def log_message(self, *a):
        pass


server = http.server.ThreadingHTTPServer((args.host, int(args.port)), Handler)
print(f"stand-in SGLang server listening on {args.host}:{args.port} tp={args.tp} model={args.model_path}", flush=True)
server.serve_forever()
'''


def _sgl_kernel_stand_in() -> Path | None:
    """The directory holding the repository's CPU stand-in for SGLang's `sgl_kernel` (written by the SGLang-on-CPU
    work), which SGLang's CPU engine needs importable."""
    for found in sorted((REPO / "dapo_megatron").rglob("sgl_kernel")):
        return found.parent
    return None


def _real_sglang_usable() -> bool:
    try:
        ok = subprocess.run([SGLANG_PYTHON, "-c", "import sglang"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    return ok and _sgl_kernel_stand_in() is not None


def _sglang_server_env(tmp_path: Path) -> tuple[dict[str, str], Path, str]:
    """(environment for the job, model directory, which server) — the real SGLang when usable, else the stand-in."""
    model_dir = tmp_path / "model"
    if _real_sglang_usable():
        from tiny_models import build_tiny_qwen2  # tests/ is on sys.path (conftest.py)

        build_tiny_qwen2(model_dir)
        env = _job_env(tmp_path, SGLANG_PYTHON=SGLANG_PYTHON, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1",
                       TRANSFORMERS_OFFLINE="1", SGLANG_HEALTH_DEADLINE_S="300",
                       SGLANG_EXTRA_ARGS="--device cpu --max-total-tokens 4096 --sleep-on-idle --dtype float32")
        env["PYTHONPATH"] = f"{_sgl_kernel_stand_in()}:{REPO}"
        return env, model_dir, "real SGLang"
    model_dir.mkdir()
    server = tmp_path / "stand_in_sglang_server.py"
    server.write_text(STAND_IN_SERVER)
    env = _job_env(tmp_path, SGLANG_SERVER_CMD=f"{sys.executable} {server}", SGLANG_HEALTH_DEADLINE_S="60")
    return env, model_dir, "stand-in server"


def _write_sglang_config(tmp_path: Path, model_dir: Path, **extra: object) -> Path:
    config = {"model": {"source": "hf", "hf_path": str(model_dir)}, "data": {"source": "synthetic"},
              "rollout": {"engine": "sglang"}, **extra}
    path = tmp_path / "sglang_run.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def test_failing_trainer_exit_code_comes_back_and_servers_are_stopped(tmp_path):
    env, model_dir, which = _sglang_server_env(tmp_path)
    print(f"SGLang side of this test: {which}")
    # Valid as a config, impossible at launch: TP 3 does not divide a world of 2 ranks, so the trainer fails after
    # the servers are healthy (today, before the trainer CLI exists, it fails on the missing module instead).
    config = _write_sglang_config(tmp_path, model_dir, parallel={"tensor": 3})
    job = submit([*CPU_JOB, "slurm/dapo_train_sglang.sbatch", "--sglang-nodes=1", str(config),
                  "trainer.total_steps=1"], tmp_path, env, deadline_s=600)
    assert "server(s) healthy" in job.output, job.output
    match = re.search(r"trainer step exited with code (\d+)", job.output)
    assert match, job.output
    assert job.returncode == int(match.group(1)) != 0, job.output
    assert "stopping the sglang-servers step" in job.output, job.output
    logs = list((tmp_path / "runs").glob("*/logs/sglang-*.log"))
    assert logs, "no server log written"
    if which == "stand-in server":
        assert "stand-in SGLang server listening" in logs[0].read_text()
    key_file = next((tmp_path / "runs").glob("*/sglang_api_key"))
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    deadline = time.monotonic() + 15  # SLURM's own step cleanup is asynchronous; ours should already be done
    while (left := processes_of_job(job.job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of job {job.job_id} still running: {left}"


def test_server_failure_during_training_stops_the_trainer(tmp_path):
    """A server that dies while the trainer runs ends the job with an error, long before the trainer would end.
    Both sides are stand-ins here (the trainer sleeps 300 s in place of training): what is under test is the
    script's reaction to the server step ending."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    server = tmp_path / "stand_in_sglang_server.py"
    server.write_text(STAND_IN_SERVER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/bash\nif [ \"$1 $2\" = \"-m dapo_megatron.cli\" ]; then echo stand-in trainer; exec sleep 300; fi\n"
                      f"exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    env = _job_env(tmp_path, DAPO_PYTHON=str(python), SGLANG_SERVER_CMD=f"{sys.executable} {server}",
                   SGLANG_EXTRA_ARGS="--die-after-s 6", SGLANG_HEALTH_DEADLINE_S="60")
    job = submit([*CPU_JOB, "slurm/dapo_train_sglang.sbatch", str(_write_sglang_config(tmp_path, model_dir))],
                 tmp_path, env, deadline_s=240)
    assert job.returncode != 0, job.output
    assert "stand-in trainer" in job.output, job.output
    assert "the SGLang server step ended" in job.output and "stopping the dapo-trainer step" in job.output, job.output
    assert job.seconds < 120, f"the job took {job.seconds:.0f} s: the trainer was not stopped"
    deadline = time.monotonic() + 15
    while (left := processes_of_job(job.job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of job {job.job_id} still running: {left}"


def test_bad_config_fails_before_any_server_starts(tmp_path):
    config = _write_sglang_config(tmp_path, tmp_path, trainer={"no_such_key": 1})
    job = submit([*CPU_JOB, "slurm/dapo_train_sglang.sbatch", str(config)], tmp_path,
                 _job_env(tmp_path, SGLANG_SERVER_CMD="false"), deadline_s=180)
    assert job.returncode != 0
    assert "trainer.no_such_key" in job.output, job.output
    assert "SGLang server(s)" not in job.output  # failed before the server step
    assert not list((tmp_path / "runs").glob("*/logs/sglang-*.log"))


def test_plain_script_returns_the_trainers_exit_code(tmp_path):
    """dapo_train.sbatch with an unknown config key: the trainer's non-zero code is the job's code."""
    config = tmp_path / "bad.yaml"
    config.write_text("trainer: {no_such_key: 1}\n")
    job = submit([*CPU_JOB, "slurm/dapo_train.sbatch", str(config)], tmp_path, _job_env(tmp_path), deadline_s=180)
    match = re.search(r"trainer step exited with code (\d+)", job.output)
    assert match, job.output
    assert job.returncode == int(match.group(1)) != 0, job.output
    assert "2 trainer ranks on" in job.output


# ------------------------------------------------------------------------------------------------------- (c)


# The tiny CPU config shrunk to seconds per step: no warm-start, small batches, every group trained on.
SMALL_RUN = ["trainer.total_steps=2", "trainer.save_every=1", "warm_start.enabled=false",
             "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
             "algorithm.dynamic_sampling=false", "data.synthetic.num_train=200", "data.synthetic.num_heldout=8",
             "eval.every=0", "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4"]


@pytest.mark.parametrize("layout", [[], ["parallel.tensor=2"]], ids=["dp2", "tp2"])
def test_tiny_cpu_training_job(tmp_path, layout):
    job = submit([*CPU_JOB, "slurm/dapo_train.sbatch", str(TINY_CPU_CONFIG), *SMALL_RUN, *layout],
                 tmp_path, _job_env(tmp_path), deadline_s=900)
    assert job.returncode == 0, job.output[-6000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), sorted(p.name for p in run_dir.iterdir())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert metrics, "metrics.jsonl is empty"
    assert list((run_dir / "checkpoints").glob("step_*")), sorted(p.name for p in run_dir.rglob("*"))
    master_port = 20000 + int(job.job_id) % 10000  # derived from the job id by slurm/launch_plan.py
    assert re.search(rf"rendezvous \S+:{master_port},", job.output), job.output[-3000:]
