"""The restart loop of a run that heals itself (``trainer.auto_resume``), and the record of each restart.

The loop is the launcher's: ``torchrun --max-restarts N`` starts every worker again when one fails (the watchdog's
exit included, :mod:`.watchdog`), and ``slurm/dapo_train.sbatch`` requeues its job (``scontrol requeue``) when the
trainer step ended in a way a restart can heal (:func:`restart_may_heal`). What a start of ``train`` does in such a
run:

* with ``trainer.auto_resume`` it continues the run its directory holds from the newest complete checkpoint, as
  ``--resume`` does (a directory without a run starts at step 0), so the launcher's unchanged command line resumes;
* a start the launcher counts as a restart (torchrun's TORCHELASTIC_RESTART_COUNT, SLURM's SLURM_RESTART_COUNT) or that
  continued a run on its own appends one row to ``<run_dir>/restarts.jsonl`` (:class:`RestartRecord`): when, the
  launcher and its count, the checkpoint resumed from, the steps the failed attempt had logged past it (trained again:
  lost work, never trained twice — their rows are dropped before they are logged again) and the last fault the
  watchdog recorded (``faults.jsonl``);
* a launcher count past ``trainer.max_restarts`` is refused (:class:`RestartLimitError`, a launch error: the SLURM
  script does not requeue it), so a fault that comes back every time ends the job instead of looping.

``python -m dapo_megatron.run.restarts may-heal CODE`` exits 0 when a run that ended with CODE is worth restarting
(what the SLURM script asks before it requeues its job).
"""

from __future__ import annotations

import datetime
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from dapo_megatron.launch_env import LaunchEnv
from dapo_megatron.metrics.writer import read_metrics
from dapo_megatron.run.watchdog import FAULTS_FILE
from dapo_megatron.user_errors import EXIT_CODES, UserError

RESTARTS_FILE = "restarts.jsonl"
# Exit codes a restart cannot heal: the same config, data, model or process layout fails the same way again, and
# Ctrl-C is a person stopping the run. Everything else — a crash (1), a lost rank (the watchdog's 69, a signal's
# 128+n), a checkpoint that found no space (5), a server (6) or reward (8) that failed, a stop signal (75, 143) — may.
NOT_HEALED_BY_RESTART = frozenset({EXIT_CODES["config"], EXIT_CODES["data"], EXIT_CODES["model"],
                                   EXIT_CODES["launch"], 130})


class RestartLimitError(UserError, RuntimeError, kind="launch"):
    """The launcher restarted the job more often than ``trainer.max_restarts`` allows."""


def restart_may_heal(exit_code: int) -> bool:
    """Whether a run that ended with ``exit_code`` is worth starting again (0: it is done)."""
    return exit_code != 0 and exit_code not in NOT_HEALED_BY_RESTART


def check_restart_limit(env: LaunchEnv, max_restarts: int, run_dir: str | Path) -> None:
    if env.restart_count > max_restarts:
        raise RestartLimitError(f"{env.launcher} restarted this job {env.restart_count} times, more than "
                                f"trainer.max_restarts={max_restarts}: not again (what failed: "
                                f"{Path(run_dir) / FAULTS_FILE}, {Path(run_dir) / RESTARTS_FILE}, the log)")


@dataclass
class RestartRecord:
    """One row of ``restarts.jsonl``; made on rank 0 before the resume (:meth:`before_resume`), written once the
    checkpoint is loaded (:meth:`write`)."""

    time: str
    launcher: str
    launcher_restart: int  # the launcher's count: 0 for a first launch that continued a run on its own
    logged_step: int | None  # the newest step the failed attempt logged (None: none)
    last_fault: dict | None  # the newest row of faults.jsonl, if any
    resumed_step: int | None = None
    resumed_from: str | None = None
    steps_lost: int = 0  # logged past the checkpoint, trained again

    @classmethod
    def before_resume(cls, run_dir: str | Path, env: LaunchEnv) -> "RestartRecord":
        run_dir = Path(run_dir)
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        steps = [row["step"] for row in rows if isinstance(row.get("step"), int)]
        return cls(time=_now(), launcher=env.launcher, launcher_restart=env.restart_count,
                   logged_step=max(steps) if steps else None, last_fault=_last_row(run_dir / FAULTS_FILE))

    def write(self, run_dir: str | Path, step: int, resumed_from: Path | None) -> None:
        self.resumed_step, self.resumed_from = step, str(resumed_from) if resumed_from else None
        self.steps_lost = max(0, (self.logged_step or 0) - step)
        with open(Path(run_dir) / RESTARTS_FILE, "a") as file:
            file.write(json.dumps(asdict(self)) + "\n")


def read_restarts(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / RESTARTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _last_row(path: Path) -> dict | None:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:  # a line torn by the kill that followed it
            continue
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "may-heal" or not args[1].lstrip("-").isdigit():
        print("usage: python -m dapo_megatron.run.restarts may-heal EXIT_CODE", file=sys.stderr)
        return 2
    return 0 if restart_may_heal(int(args[1])) else 1


if __name__ == "__main__":
    sys.exit(main())
