"""Real SLURM jobs on one node of a running cluster (CI starts one with ``scripts/slurm_cluster.sh start --nodes 3``;
the single-node layout works as well; CPU only).

(a) ``srun`` with 2 tasks: what ``launch_env.launch_env()`` sees in each task.
(b) ``slurm/dapo_train_sglang.sbatch`` on one node (servers and trainer share it) with a real SGLang server, whose
    trainer fails after the servers are up: the failure's exit code and reason come back through ``sbatch --wait``,
    the script itself stops the server step and no process of the job is left.
    A config with an unknown key fails before any server starts.
(c) ``slurm/dapo_train.sbatch`` on ``examples/tiny_cpu.yaml`` with 2 tasks (DP = 2, and TP = 2): exit 0 and a run
    directory with TensorBoard events, metrics.jsonl and a checkpoint; and with a rank SIGKILLed mid-run, the job
    requeued once and resumed (DAPO_MAX_REQUEUES).
Servers failing mid-run, and everything across nodes, are in test_slurm_multinode.py.

Each job runs with a time limit and the test with a deadline; a job still running at the deadline is cancelled.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from slurm_harness import (
    REPO,
    assert_nothing_left,
    cluster_unavailable,
    job_env,
    processes_of_job,
    sglang_job_env,
    start_job,
    submit,
)

TINY_CPU_CONFIG = REPO / "examples" / "tiny_cpu.yaml"
# Resources every test job asks for: one node, no GPUs, 2 tasks.
CPU_JOB = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=10"]

pytestmark = [pytest.mark.slow, pytest.mark.slurm,
              pytest.mark.skipif((why := cluster_unavailable()) is not None, reason=why or "")]


# ------------------------------------------------------------------------------------------------------- (a)


def test_srun_two_tasks_see_their_ranks(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""\
        import dataclasses, json, socket
        from dapo_megatron.launch_env import launch_env
        print("LAUNCH_ENV " + json.dumps(dict(dataclasses.asdict(launch_env()), host=socket.gethostname())))
    """))
    job = submit([*CPU_JOB, "--wrap", f"srun --ntasks=2 {sys.executable} {probe}"], tmp_path, job_env(tmp_path),
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


def _write_sglang_config(tmp_path: Path, model_dir: Path, **extra: object) -> Path:
    config = {"model": {"source": "hf", "hf_path": str(model_dir)}, "data": {"source": "synthetic"},
              "rollout": {"engine": "sglang"}, **extra}
    path = tmp_path / "sglang_run.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def test_failing_trainer_exit_code_and_reason_come_back_and_servers_are_stopped(tmp_path):
    from tiny_models import build_tiny_qwen2  # tests/ is on sys.path (pyproject.toml)

    env = sglang_job_env(tmp_path, SGLANG_HEALTH_DEADLINE_S="600")
    model_dir = build_tiny_qwen2(tmp_path / "model")
    # Valid as a config, impossible at launch: TP 3 does not divide a world of 2 ranks, so the trainer fails after
    # the servers are healthy.
    config = _write_sglang_config(tmp_path, model_dir, parallel={"tensor": 3})
    job = submit([*CPU_JOB, "slurm/dapo_train_sglang.sbatch", "--sglang-nodes=1", str(config),
                  "trainer.total_steps=1"], tmp_path, env, deadline_s=1200)
    assert "server(s) healthy" in job.output, job.output
    assert "world size 2 is not divisible by tensor_parallel × pipeline_parallel = 3 × 1 = 3" in job.output, \
        job.output[-6000:]
    match = re.search(r"trainer step exited with code (\d+)", job.output)
    assert match, job.output
    assert job.returncode == int(match.group(1)) != 0, job.output
    assert "stopping the sglang-servers step" in job.output, job.output
    logs = list((tmp_path / "runs").glob("*/logs/sglang-*.log"))
    assert logs, "no server log written"
    assert "The server is fired up and ready to roll" in logs[0].read_text(), logs[0].read_text()[-3000:]
    key_file = next((tmp_path / "runs").glob("*/sglang_api_key"))
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    assert_nothing_left(job.job_id)


def test_bad_config_fails_before_any_server_starts(tmp_path):
    config = _write_sglang_config(tmp_path, tmp_path, trainer={"no_such_key": 1})
    job = submit([*CPU_JOB, "slurm/dapo_train_sglang.sbatch", str(config)], tmp_path,
                 job_env(tmp_path, SGLANG_SERVER_CMD="false"), deadline_s=180)
    assert job.returncode != 0
    assert "trainer.no_such_key" in job.output, job.output
    assert "SGLang server(s)" not in job.output  # failed before the server step
    assert not list((tmp_path / "runs").glob("*/logs/sglang-*.log"))


def test_plain_script_returns_the_trainers_exit_code(tmp_path):
    """dapo_train.sbatch with an unknown config key: the trainer's non-zero code is the job's code."""
    config = tmp_path / "bad.yaml"
    config.write_text("trainer: {no_such_key: 1}\n")
    job = submit([*CPU_JOB, "slurm/dapo_train.sbatch", str(config)], tmp_path, job_env(tmp_path), deadline_s=180)
    match = re.search(r"trainer step exited with code (\d+)", job.output)
    assert match, job.output
    assert job.returncode == int(match.group(1)) != 0, job.output
    assert "trainer.no_such_key" in job.output, job.output[-3000:]
    assert "2 trainer ranks on" in job.output


# ------------------------------------------------------------------------------------------------------- (c)


# The tiny CPU config shrunk to seconds per step: no warm-start, small batches, every group trained on.
SMALL_RUN = ["trainer.total_steps=2", "trainer.save_every=1", "warm_start.enabled=false",
             "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
             "algorithm.dynamic_sampling=false", "data.synthetic.num_train=200", "data.synthetic.num_heldout=8",
             "eval.every=0", "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4"]


def test_tiny_cpu_training_job_tp2(tmp_path):
    """DP = 2 is the requeue test's job below (the same checks, and a restart)."""
    job = submit([*CPU_JOB, "slurm/dapo_train.sbatch", str(TINY_CPU_CONFIG), *SMALL_RUN, "parallel.tensor=2"],
                 tmp_path, job_env(tmp_path), deadline_s=900)
    assert job.returncode == 0, job.output[-6000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    _assert_a_finished_run(run_dir, job)


def _assert_a_finished_run(run_dir: Path, job) -> None:
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), sorted(p.name for p in run_dir.iterdir())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert metrics, "metrics.jsonl is empty"
    assert list((run_dir / "checkpoints").glob("step_*")), sorted(p.name for p in run_dir.rglob("*"))
    master_port = 20000 + int(job.job_id) % 10000  # derived from the job id by slurm/launch_plan.py
    assert re.search(rf"rendezvous \S+:{master_port},", job.output), job.output[-3000:]


def test_a_killed_rank_requeues_the_job_which_resumes_from_its_newest_checkpoint(tmp_path):
    """Issue 42.2, SLURM's restart loop, on the DP = 2 job the plain training test ran before (its checks too): with
    DAPO_MAX_REQUEUES=1, rank 1 SIGKILLed once checkpoint 1 is complete
    ends the step (srun --kill-on-bad-exit); the script requeues the job, whose second start (SLURM_RESTART_COUNT=1)
    continues from the newest complete checkpoint to the end: exit 0, one row in restarts.jsonl, no step logged
    twice. SLURM holds a requeued job for ~2 minutes before it starts it again; the test starts it at once."""
    job = start_job([*CPU_JOB, "--open-mode=append", "slurm/dapo_train.sbatch", str(TINY_CPU_CONFIG),
                     *SMALL_RUN, "trainer.total_steps=4"], tmp_path, job_env(tmp_path, DAPO_MAX_REQUEUES="1"))
    run_dir = tmp_path / "runs" / f"dapo-train-{job.job_id}"
    deadline = time.monotonic() + 600
    while not (run_dir / "checkpoints" / "step_000001" / "COMPLETE").exists():
        assert job.running() and time.monotonic() < deadline, job.output()[-3000:]
        time.sleep(0.2)
    [rank1] = [int(p.split(":")[0]) for p in processes_of_job(job.job_id)
               if "dapo_megatron.cli train" in p and _environ(int(p.split(":")[0])).get("SLURM_PROCID") == "1"]
    os.kill(rank1, signal.SIGKILL)
    job.start_again_once_requeued(deadline_s=600)
    result = job.wait(deadline_s=900)
    assert result.returncode == 0, result.output[-6000:]
    _assert_a_finished_run(run_dir, result)  # what the plain DP = 2 job checked
    assert f"requeueing job {job.job_id} (restart 1 of at most 1)" in result.output
    [restart] = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert (restart["launcher"], restart["launcher_restart"]) == ("slurm", 1) and restart["resumed_step"] >= 1
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(steps) == list(range(5)), steps  # steps 0 (validation) to 4, each once


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
