"""Issue 42.2, the restart loop's parts: what a start under a launcher's restart (or ``trainer.auto_resume``) does
with the run its directory holds, the bound on restarts, the row each restart leaves, which exit codes a restart
may heal (the SLURM script's requeue), and ranks of a torchrun restart rendezvousing in keys of their own (real
processes on a real TCPStore that outlives the attempt, as torchrun's agent's does)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest
from cli_runs import TINY
from torch.distributed import TCPStore

from dapo_megatron.commands.train import continuation
from dapo_megatron.config import load_config
from dapo_megatron.launch_env import free_port
from dapo_megatron.run.restarts import RestartLimitError, read_restarts, restart_may_heal
from dapo_megatron.user_errors import EXIT_CODES


def _args(**flags) -> argparse.Namespace:
    return argparse.Namespace(resume=flags.get("resume", False), overwrite=flags.get("overwrite", False))


@pytest.fixture
def launched(monkeypatch):
    """A torchrun worker of a world of one, restarted ``count`` times."""
    def restart(count: int) -> None:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))
    return restart


def _run_with_metrics(run_dir, steps: int) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in range(steps + 1)))
    (run_dir / "faults.jsonl").write_text(json.dumps({"kind": "rank silent", "rank": 1, "step": 5}) + "\n")


def test_a_restarted_start_continues_the_run_records_it_and_never_moves_it_aside(tmp_path, launched):
    run_dir = tmp_path / "run"
    _run_with_metrics(run_dir, steps=5)
    config = load_config(TINY, [f"trainer.run_dir={run_dir}"])  # auto_resume off: a launcher's restart is enough
    launched(2)
    resume, overwrite, record = continuation(_args(overwrite=True), config)  # the first launch had --overwrite
    assert (resume, overwrite) == (True, False)
    assert (record.launcher, record.launcher_restart, record.logged_step) == ("torchrun", 2, 5)
    assert record.last_fault == {"kind": "rank silent", "rank": 1, "step": 5}
    record.write(run_dir, step=4, resumed_from=run_dir / "checkpoints" / "step_000004")
    [row] = read_restarts(run_dir)
    assert (row["resumed_step"], row["steps_lost"]) == (4, 1)
    # control: a first launch without auto_resume leaves the decision to --resume / --overwrite
    launched(0)
    assert continuation(_args(), config) == (False, False, None)


def test_auto_resume_continues_a_run_on_a_first_launch_and_starts_a_fresh_one_in_an_empty_directory(tmp_path,
                                                                                                  launched):
    launched(0)
    empty = load_config(TINY, [f"trainer.run_dir={tmp_path / 'new'}", "trainer.auto_resume=true"])
    assert continuation(_args(), empty) == (False, False, None)
    _run_with_metrics(tmp_path / "old", steps=3)
    resume, _, record = continuation(_args(), load_config(TINY, [f"trainer.run_dir={tmp_path / 'old'}",
                                                                  "trainer.auto_resume=true"]))
    assert resume and record.launcher_restart == 0 and record.logged_step == 3


def test_a_restart_past_max_restarts_is_a_launch_error_the_requeue_does_not_repeat(tmp_path, launched):
    config = load_config(TINY, [f"trainer.run_dir={tmp_path}", "trainer.max_restarts=3"])
    launched(3)
    continuation(_args(), config)  # the third restart is allowed
    launched(4)
    with pytest.raises(RestartLimitError, match=r"torchrun restarted this job 4 times, more than "
                                                r"trainer.max_restarts=3: not again") as refused:
        continuation(_args(), config)
    assert refused.value.exit_code == EXIT_CODES["launch"] and not restart_may_heal(refused.value.exit_code)


@pytest.mark.parametrize("code, heals", [(0, False), (1, True), (2, False), (3, False), (4, False), (5, True),
                                         (6, True), (7, False), (8, True), (69, True), (75, True), (130, False),
                                         (137, True), (143, True)])
def test_which_exit_codes_a_restart_may_heal(code, heals):
    assert restart_may_heal(code) is heals


ATTEMPT = textwrap.dedent("""
    import datetime, os, sys, time
    rank, delay = int(sys.argv[1]), float(sys.argv[2])
    time.sleep(delay)
    import torch, torch.distributed as dist
    from dapo_megatron.launch_env import launch_env
    from dapo_megatron.platform import rendezvous_store
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", store=rendezvous_store(launch_env(), timeout), rank=rank, world_size=2,
                            timeout=timeout)  # as init_distributed does
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} rank {rank}: {total.item():g}", flush=True)
    dist.destroy_process_group()
""")


def test_the_ranks_of_a_restart_do_not_read_the_addresses_of_the_attempt_before(tmp_path):
    """torchrun's agent keeps its store across --max-restarts. Attempt 0 runs and ends; in attempt 1 rank 1 starts
    at once and rank 0 two seconds later: without keys of its own, rank 1 read rank 0's gloo address of attempt 0
    (nobody listens there any more: connectFullMesh failed, connection refused)."""
    port = free_port()
    agent_store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 - it serves

    def attempt(number: int, delays: tuple[float, float]) -> list[str]:
        env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TORCHELASTIC_RESTART_COUNT": str(number)}
        ranks = [subprocess.Popen([sys.executable, "-c", ATTEMPT, str(rank), str(delays[rank])],
                                  env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        outputs = [process.communicate(timeout=120) for process in ranks]
        assert all(process.returncode == 0 for process in ranks), [err[-1500:] for _, err in outputs]
        return [out.strip() for out, _ in outputs]

    assert attempt(0, (0.0, 0.0)) == ["attempt 0 rank 0: 3", "attempt 0 rank 1: 3"]
    assert attempt(1, (2.0, 0.0)) == ["attempt 1 rank 0: 3", "attempt 1 rank 1: 3"]
