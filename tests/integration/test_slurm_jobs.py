"""Real SLURM jobs on one node of a running cluster (CI starts one with ``scripts/slurm_cluster.sh start --nodes 3``;
the single-node layout works as well; CPU only).

(a) ``srun`` with 2 tasks: what ``launch_env.launch_env()`` sees in each task.
(b) ``slurm/dapo_train_sglang.sbatch`` on one node (servers and trainer share it) with a real SGLang server, whose
    trainer fails after the servers are up: the failure's exit code and reason come back through ``sbatch --wait``,
    the script itself stops the server step and no process of the job is left.
    A config with an unknown key fails before any server starts.
(c) ``slurm/dapo_train.sbatch`` on ``examples/tiny_cpu.yaml`` with 2 tasks (DP = 2, and TP = 2): exit 0 and a run
    directory with TensorBoard events, metrics.jsonl and a checkpoint.
Servers failing mid-run, and everything across nodes, are in test_slurm_multinode.py.

Each job runs with a time limit and the test with a deadline; a job still running at the deadline is cancelled.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from slurm_harness import REPO, assert_nothing_left, cluster_unavailable, job_env, sglang_job_env, submit

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


@pytest.mark.parametrize("layout", [[], ["parallel.tensor=2"]], ids=["dp2", "tp2"])
def test_tiny_cpu_training_job(tmp_path, layout):
    job = submit([*CPU_JOB, "slurm/dapo_train.sbatch", str(TINY_CPU_CONFIG), *SMALL_RUN, *layout],
                 tmp_path, job_env(tmp_path), deadline_s=900)
    assert job.returncode == 0, job.output[-6000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), sorted(p.name for p in run_dir.iterdir())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert metrics, "metrics.jsonl is empty"
    assert list((run_dir / "checkpoints").glob("step_*")), sorted(p.name for p in run_dir.rglob("*"))
    master_port = 20000 + int(job.job_id) % 10000  # derived from the job id by slurm/launch_plan.py
    assert re.search(rf"rendezvous \S+:{master_port},", job.output), job.output[-3000:]
