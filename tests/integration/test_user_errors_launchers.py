"""The user-error contract under the multi-process launchers, 2 ranks each: the error found on rank 0 (the input
checks run there) reaches every rank with its kind, every rank exits with the kind's code, and the one line is
printed once, by rank 0, with no traceback from any rank.

* torchrun: ``torchrun --nproc-per-node 2 -m dapo_megatron.cli train ...``; torchrun itself exits 1 on any failed
  worker (torch's choice), stops the other workers, and names the first failed worker's exit code as the root cause
  in its failure summary;
* srun: the command every task of ``srun -n 2`` runs, with the variables srun gives each task (SLURM_PROCID,
  SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST; the rendezvous from MASTER_ADDR/MASTER_PORT, as
  slurm/*.sbatch export them). srun's own exit code is the highest of its tasks'. A real srun is exercised by the
  SLURM tier (tests/integration/test_slurm_jobs.py), on a machine where the cluster runs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from cli_runs import REPO, TINY
from test_user_errors import SMALL

from dapo_megatron.launch_env import free_port
from dapo_megatron.user_errors import EXIT_CODES

pytestmark = pytest.mark.slow
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                    "SLURM_LOCALID", "SLURM_JOB_NODELIST")


def _bad_data_run(tmp_path) -> tuple[list[str], str]:
    missing = tmp_path / "nowhere" / "train.jsonl"
    args = ["-m", "dapo_megatron.cli", "train", str(TINY), *SMALL, f"trainer.run_dir={tmp_path / 'run'}",
            "data.source=dapo_math", f"data.train_files=[{missing}]"]
    return args, f"data error: {missing}: no such data file"


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_torchrun_workers_exit_with_the_kinds_code_and_rank0_says_why(tmp_path):
    args, line = _bad_data_run(tmp_path)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                             f"--master-port={free_port()}", *args], capture_output=True, text=True, cwd=REPO,
                            env=_clean_env(), timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]  # torchrun's own code for "a worker failed"
    assert output.count(line) == 1, output[-3000:]  # once: rank 0 prints it, rank 1 does not
    summary = output.split("Failures:")[-1]
    root_cause = re.search(r"exitcode\s*:\s*(-?\d+)", summary.split("Root Cause")[1])
    assert root_cause and int(root_cause.group(1)) == EXIT_CODES["data"], output[-3000:]
    # The other worker exited with the same code, or torchrun stopped it first (SIGTERM) once one had failed.
    other_codes = {int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", summary)}
    assert other_codes <= {EXIT_CODES["data"], -signal.SIGTERM}, output[-3000:]
    assert "/dapo_megatron/" not in output, output[-3000:]  # torchrun's own traceback only, none from a rank
    assert "[rank0]" not in output and "[rank1]" not in output, output[-3000:]


def test_srun_tasks_exit_with_the_kinds_code_and_rank0_says_why(tmp_path):
    args, line = _bad_data_run(tmp_path)
    port = str(free_port())
    tasks = [subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO, env=_clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2",
                                                       SLURM_LOCALID=str(rank), SLURM_JOB_NODELIST="localhost",
                                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in range(2)]
    (out0, err0), (out1, err1) = [task.communicate(timeout=600) for task in tasks]
    assert [task.returncode for task in tasks] == [EXIT_CODES["data"]] * 2, (err0[-2000:], err1[-2000:])
    assert err0.strip().splitlines()[-1] == line, err0[-2000:]
    assert " error: " not in err1 + out1, err1[-2000:]  # rank 1 is quiet
    for text in (err0, err1):
        assert "Traceback" not in text and "[rank" not in text, text[-2000:]
