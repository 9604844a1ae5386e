"""The sbatch scripts on a multi-node cluster: 3 nodes in network namespaces with their own addresses and
hostnames and a shared filesystem, one task per node (``scripts/slurm_cluster.sh start --nodes 3``, which CI's full
test command runs).

(a) ``slurm/dapo_train.sbatch``, DP = 2 with one trainer rank on each of 2 nodes: gloo rendezvous across nodes at
    the first node's address, checkpoints in the shared run directory, and ``scancel`` + resubmit with ``--resume``
    logs exactly the metrics of an uninterrupted run.
(b) ``slurm/dapo_train_sglang.sbatch``: the SGLang server on node1, the trainer (DP = 2) on node2 + node3, attached
    by URL with the API key; weights over the ``distributed`` transport (gloo, across nodes; the ``disk`` one reads a
    shared folder, tested on one node). While the job runs the test asks the server for greedy output at a trained
    weight version; it must equal HF ``transformers`` greedy output from that step's checkpoint (and differ from the
    initial model's: the control).
    The servers are stopped when the trainer ends; nothing is left on any node.
(c) The rendezvous-address control: the same distributed-transport job with the weight-update address forced to
    ``127.0.0.1`` (what the trainer used before it derived a routable one) fails, naming the weight-update group.
(d) A server killed mid-run (all its processes, SIGKILL): the job fails with a message naming the cause within the
    configured request timeout (plus a margin for SLURM's teardown); nothing is left on any node.
(e) The control of "nothing is left": the check sees a running job's processes on every node.

Deadlines come from the configured timeouts with generous margins: the machine's 2 cores are shared.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runs import read_run_metrics
from sglang_fixtures import hf_greedy_until_eos
from slurm_harness import (
    REPO,
    RunningJob,
    assert_nothing_left,
    cluster_unavailable,
    job_env,
    processes_on_nodes,
    rendezvous_line,
    sglang_job_env,
    start_job,
    submit,
)
from tiny_models import load_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.slurm,
              pytest.mark.skipif((why := cluster_unavailable(min_nodes=3)) is not None, reason=why or "")]

TINY_CPU_CONFIG = REPO / "examples" / "tiny_cpu.yaml"
ON_NODES = ["--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0", "--time=20"]
STEPS = 4
RUN = [f"trainer.total_steps={STEPS}", "trainer.save_every=1", f"trainer.keep_checkpoints={STEPS}",
       "warm_start.enabled=false", "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
       "algorithm.dynamic_sampling=false", "data.synthetic.num_train=200", "data.synthetic.num_heldout=8",
       "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4"]

REQUEST_TIMEOUT_S = 90  # rollout.sglang.request_timeout_s of the SGLang jobs: the bound a failure must meet
HEALTH_DEADLINE_S = 600  # a CPU SGLang server starts in 30-80 s here, more when the machine is busy
SGLANG_JOB_DEADLINE_S = HEALTH_DEADLINE_S + 6 * REQUEST_TIMEOUT_S + 300
GREEDY_TOKENS = 12
LOOPBACK_TIMEOUT_S = 12  # the request timeout of (c): how long the trainer waits for servers that never join
# how a stopped job says so in its output: slurmstepd's CANCELLED line or the sbatch script's trap
STOPPED_LINE = re.compile(r"CANCELLED|stop signal")


def _watch(job: RunningJob, probe, poll_s: float = 0.5) -> list:
    """Call ``probe()`` every ``poll_s`` while the job runs; the non-None results, in order."""
    seen = []
    while job.running():
        result = probe()
        if result is not None:
            seen.append(result)
        time.sleep(poll_s)
    return seen


def _nodes_running(fragment: str) -> set[str]:
    """Nodes with a Python process whose command line holds ``fragment`` (not the ``srun`` that started it)."""
    return {node for node, procs in processes_on_nodes().items()
            if any(cmd.startswith(sys.executable) and fragment in cmd for _, cmd in procs)}


# ------------------------------------------------------------------------------------------------------- (a)


def test_dp2_across_two_nodes_trains_checkpoints_and_resumes_exactly_after_scancel(tmp_path):
    # Steps enough that the run is still going when scancel arrives after the first checkpoint.
    steps = 8
    args = ["--nodes=2", *ON_NODES, "slurm/dapo_train.sbatch", str(TINY_CPU_CONFIG), *RUN,
            f"trainer.total_steps={steps}"]

    reference = start_job(args, tmp_path, job_env(tmp_path, RUN_DIR=str(tmp_path / "reference")))
    trainer_nodes = set().union(*_watch(reference, lambda: _nodes_running("dapo_megatron.cli train")))
    job = reference.wait(deadline_s=900)
    assert job.returncode == 0, job.output[-6000:]
    assert len(trainer_nodes) == 2, f"trainer ranks ran on {trainer_nodes}, expected two nodes"
    rendezvous = rendezvous_line(job.output)
    assert rendezvous and rendezvous.group(1) == "2", job.output[-3000:]
    assert not rendezvous.group(3).startswith("127."), f"rendezvous on a loopback address: {rendezvous.group(0)}"
    expected = read_run_metrics(tmp_path / "reference")
    assert [row["step"] for row in expected] == list(range(steps + 1))
    assert (tmp_path / "reference" / "checkpoints" / f"step_{steps:06d}" / "COMPLETE").exists()

    # The same run, cancelled once its first checkpoint is complete, then resubmitted with --resume.
    run_dir = tmp_path / "interrupted"
    interrupted = start_job(args, tmp_path, job_env(tmp_path, RUN_DIR=str(run_dir)))
    first_checkpoint = run_dir / "checkpoints" / "step_000001" / "COMPLETE"
    deadline = time.monotonic() + 900
    while interrupted.running() and not first_checkpoint.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    interrupted.cancel()
    cancelled = interrupted.wait(deadline_s=1200)
    assert first_checkpoint.exists(), cancelled.output[-4000:]
    # sbatch --wait may return 0 for a cancelled job whose batch script trapped the signal: the script's trap line
    # or slurmstepd's CANCELLED line says it was stopped (slurmstepd's may reach the file a moment after the end)
    output_deadline = time.monotonic() + 15
    while not (stopped := STOPPED_LINE.search(output := interrupted.output())) and time.monotonic() < output_deadline:
        time.sleep(0.5)
    assert stopped, "the job ended before scancel reached it: nothing was interrupted\n" + output[-3000:]
    assert not (run_dir / "checkpoints" / f"step_{steps:06d}").exists()
    assert_nothing_left(cancelled.job_id)

    resumed = submit([*args, "--resume"], tmp_path, job_env(tmp_path, RUN_DIR=str(run_dir)), deadline_s=900)
    assert resumed.returncode == 0, resumed.output[-6000:]
    match = re.search(r"resumed from \S+step_(\d+) \(step (\d+)\)", resumed.output)
    assert match and 1 <= int(match.group(2)) < steps, resumed.output[-3000:]
    print(f"resumed at step {match.group(2)} of {steps}; comparing {len(expected[-1])} metrics per step")
    assert read_run_metrics(run_dir) == expected


# ------------------------------------------------------------------------------------------------------- (b)


@pytest.fixture(scope="module")
def tiny_model(model_dir):
    from tiny_models import sample_prompts  # tests/ is on sys.path (pyproject.toml)

    return model_dir, sample_prompts(model_dir, 4)


def _sglang_config(tmp_path: Path, model_dir: Path) -> Path:
    config = {"base": str(TINY_CPU_CONFIG), "model": {"source": "hf", "hf_path": str(model_dir)}}
    path = tmp_path / "sglang_run.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def _sglang_job(tmp_path: Path, model_dir: Path, *overrides: str) -> tuple[list[str], dict[str, str], Path]:
    run_dir = tmp_path / "run"
    args = ["--nodes=3", *ON_NODES, "slurm/dapo_train_sglang.sbatch", "--sglang-nodes", "1",
            str(_sglang_config(tmp_path, model_dir)), *RUN, f"rollout.sglang.request_timeout_s={REQUEST_TIMEOUT_S}",
            *overrides]
    env = sglang_job_env(tmp_path, RUN_DIR=str(run_dir), SGLANG_HEALTH_DEADLINE_S=str(HEALTH_DEADLINE_S))
    return args, env, run_dir


class ServerProbe:
    """The job's SGLang server seen from outside: its URL (from the job's log) and API key (from the run dir)."""

    def __init__(self, job: RunningJob, run_dir: Path):
        self.job, self.run_dir, self.client = job, run_dir, None

    def connect(self):
        from dapo_megatron.rollout.sglang.client import SGLangClient

        if self.client is None:
            match = re.search(r"SGLang server\(s\) \(TP \d+\) on \S+: (\[.*\])", self.job.output())
            key_file = self.run_dir / "sglang_api_key"
            if match and key_file.exists():
                (url,) = json.loads(match.group(1))
                self.client = SGLangClient(url, key_file.read_text().strip(), timeout_s=REQUEST_TIMEOUT_S)
        return self.client

    def version(self) -> int | None:
        try:
            client = self.connect()
            served = client.served_weight_version() if client else None
        except Exception:  # not up yet, restarting, or gone
            return None
        return int(served) if served and served.isdigit() else None

    def greedy(self, prompts: list[list[int]]) -> tuple[int, list[list[int]]] | None:
        """(version, greedy token ids) when the server served every prompt at one version throughout, else None."""
        before = self.version()
        if not before:  # version 0 is the initial model: nothing trained to compare yet
            return None
        outputs = []
        try:
            for prompt in prompts:
                payload = {"input_ids": [prompt], "sampling_params": {"temperature": 0.0,
                                                                      "max_new_tokens": GREEDY_TOKENS, "n": 1}}
                (output,) = self.client.generate(payload)
                if output["meta_info"].get("finish_reason", {}).get("type") == "abort":
                    return None  # paused by a weight update
                outputs.append([int(t) for t in output["output_ids"]])
        except Exception:
            return None
        return (before, outputs) if self.version() == before else None


def _export(checkpoint: Path, out: Path) -> Path:
    result = subprocess.run([sys.executable, "-m", "checkpoint_tools.megatron_to_hf", "--ckpt", str(checkpoint),
                             "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=600,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_sglang_server_on_another_node_serves_the_trained_weights(tmp_path, tiny_model):
    """Over the cross-node distributed transport (NCCL's role played by gloo). The disk transport reads the same
    shared folder from any node; its handoff is tested on one node (test_sglang_handoff_from_training.py)."""
    model_dir, prompts = tiny_model
    # A large learning rate and a reward that splits every group, so that every step's weights change and greedy
    # output with them (the control at the end relies on it): the random model never answers right, so the DAPO
    # rule scores every response alike, and overlong filtering would drop the truncated ones, nearly all of them.
    # (With the rule, a step trained only when the server happened to sample an early EOS: seen failing.)
    reward = tmp_path / "parity_reward.py"  # tmp_path is the cluster's shared folder
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0 if len(solution_str) % 2 else -1.0\n")
    args, env, run_dir = _sglang_job(tmp_path, model_dir, "rollout.sglang.transport=distributed", "eval.every=1",
                                     "optim.lr=0.1", f"reward.function={reward}", "algorithm.overlong_filtering=false")
    job = start_job(args, tmp_path, env)
    server = ServerProbe(job, run_dir)
    placements: dict[str, set[str]] = {"server": set(), "trainer": set()}

    def probe():
        placements["server"] |= _nodes_running("sglang.launch_server")
        placements["trainer"] |= _nodes_running("dapo_megatron.cli train")
        return server.greedy(prompts)

    served = _watch(job, probe, poll_s=0.2)
    done = job.wait(deadline_s=SGLANG_JOB_DEADLINE_S)
    assert done.returncode == 0, done.output[-6000:]
    assert placements == {"server": {"node1"}, "trainer": {"node2", "node3"}}, placements
    assert "stopping the sglang-servers step" in done.output, done.output[-3000:]
    assert_nothing_left(done.job_id)

    rows = read_run_metrics(run_dir, timings=True)
    assert [row["step"] for row in rows] == list(range(STEPS + 1))
    for row in rows[1:]:
        assert row["rollout/weight_version"] == row["step"]
        # The server's log-probs of its own samples = the policy's, at every step: it served the trained weights.
        assert row["rollout/logprob_diff/max_abs"] < 1e-3, row

    # the server joined the trainer's group at rank 0's node address, not loopback
    trainer_addr = rendezvous_line(done.output).group(3)
    server_log = "".join(path.read_text() for path in (run_dir / "logs").glob("sglang-*.log"))
    assert f"init custom process group: master_address={trainer_addr}," in server_log, server_log[-3000:]

    assert served, "never caught the server serving a trained version (the job was too quick for the probe?)"
    print(f"caught the server's greedy output at weight versions {sorted({v for v, _ in served})}")
    version, server_greedy = served[-1]
    hf_dir = _export(run_dir / "checkpoints" / f"step_{version:06d}", tmp_path / "export")
    assert server_greedy == hf_greedy_until_eos(load_hf_model(hf_dir), prompts, GREEDY_TOKENS), \
        f"server at weight version {version} != HF greedy"
    assert server_greedy != hf_greedy_until_eos(load_hf_model(model_dir), prompts, GREEDY_TOKENS), \
        "control: the initial model gives the same output"


# ------------------------------------------------------------------------------------------------------- (c)


def test_distributed_transport_fails_across_nodes_with_a_loopback_rendezvous(tmp_path, tiny_model):
    """The control of the rendezvous-address fix: 127.0.0.1 (the old hard-coded address) makes the server on
    node1 dial its own loopback; the trainer gives up after the request timeout, naming the weight-update group."""
    model_dir, _ = tiny_model
    # A shorter request timeout: the trainer waits that long for the servers to join the group.
    args, env, _ = _sglang_job(tmp_path, model_dir, "rollout.sglang.transport=distributed",
                               "rollout.sglang.weight_update_address=127.0.0.1",
                               f"rollout.sglang.request_timeout_s={LOOPBACK_TIMEOUT_S}")
    started = time.monotonic()
    job = submit(args, tmp_path, env, deadline_s=SGLANG_JOB_DEADLINE_S)
    assert job.returncode != 0, job.output[-4000:]
    assert "could not form the weight-update group (gloo, world 2) at 127.0.0.1:" in job.output, job.output[-6000:]
    healthy = re.search(r"all 1 server\(s\) healthy after (\d+) s", job.output)
    assert healthy, job.output[-4000:]
    # the trainer (start-up included) gave up within the timeout, plus a margin, once the server was up
    assert time.monotonic() - started - int(healthy.group(1)) < LOOPBACK_TIMEOUT_S + 240
    assert "stopping the sglang-servers step" in job.output
    assert_nothing_left(job.job_id)


# ------------------------------------------------------------------------------------------------------- (d)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) if proc.name.isdigit() else None
        except (OSError, IndexError, ValueError):
            continue
        if parent is not None:
            children.setdefault(parent, []).append(int(proc.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _kill_server_processes(job_id: str) -> list[str]:
    """SIGKILL the job's SGLang server and every process it forked (its workers rename themselves
    ``sglang::scheduler`` etc.): the server dies at once as a whole, as when its node fails or it is OOM-killed."""
    marker = f"SLURM_JOB_ID={job_id}".encode()
    killed = []
    for node, procs in processes_on_nodes().items():
        for pid, cmd in procs:
            try:
                in_job = marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            # the server's main process; not the batch script or the server step's srun (their arguments mention
            # sglang too)
            if in_job and cmd.startswith(sys.executable) and "sglang.launch_server" in cmd:
                tree = _descendants(pid)
                for member in tree:
                    os.kill(member, signal.SIGKILL)
                killed.append(f"{node}: {pid} {cmd[:60]} and {len(tree) - 1} child process(es)")
    return killed


def test_server_killed_mid_run_fails_the_job_clearly_within_the_timeout(tmp_path, tiny_model):
    model_dir, _ = tiny_model
    args, env, run_dir = _sglang_job(tmp_path, model_dir, "rollout.sglang.transport=disk", "trainer.total_steps=500",
                                     "trainer.save_every=0")
    job = start_job(args, tmp_path, env)
    server = ServerProbe(job, run_dir)
    deadline = time.monotonic() + HEALTH_DEADLINE_S + 10 * REQUEST_TIMEOUT_S
    while job.running() and not (server.version() or 0) >= 1 and time.monotonic() < deadline:
        time.sleep(0.5)  # until the trainer has pushed trained weights: mid-run
    assert job.running(), job.output()[-4000:]
    killed = _kill_server_processes(job.job_id)
    killed_at = time.monotonic()
    assert killed, f"no SGLang process of job {job.job_id} found on the nodes: {processes_on_nodes()}"
    print(f"killed {killed}")
    done = job.wait(deadline_s=SGLANG_JOB_DEADLINE_S)
    took = time.monotonic() - killed_at
    assert done.returncode != 0, done.output[-4000:]
    reasons = ("the SGLang server step ended", "no SGLang server left to generate on", "is not healthy")
    assert any(reason in done.output for reason in reasons), done.output[-6000:]
    assert took < REQUEST_TIMEOUT_S + 120, f"the job took {took:.0f} s to fail after the server died"
    assert_nothing_left(done.job_id)


def test_leftover_check_sees_processes_on_every_node(tmp_path):
    """The control of the 'nothing left' checks: while a job runs a step on all three nodes, they see its
    processes on each node (not only in this namespace) and fail; once it has ended, they pass."""
    job = start_job(["--nodes=3", *ON_NODES, "--wrap", "srun sleep 15"], tmp_path, job_env(tmp_path))
    deadline = time.monotonic() + 120
    while job.running() and {n for n, procs in processes_on_nodes().items()
                             if any(cmd.endswith("sleep 15") for _, cmd in procs)} != {"node1", "node2", "node3"}:
        assert time.monotonic() < deadline, f"the step never ran on every node: {processes_on_nodes()}"
        time.sleep(0.2)
    with pytest.raises(pytest.fail.Exception, match="left behind by job"):
        assert_nothing_left(job.job_id, grace_s=0)
    done = job.wait(deadline_s=180)
    assert done.returncode == 0, done.output
    assert_nothing_left(done.job_id)
