"""``dapo-megatron train``: DAPO training under the run directory's lock, until the last step or a stop signal, each
rank watched by the others (dapo_megatron.run.watchdog) and, with ``trainer.auto_resume`` or under a launcher's
restart, continuing the run its directory holds (dapo_megatron.run.restarts)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dapo_megatron.commands.process_layout import check_inputs, init_process_layout
from dapo_megatron.config import DAPOConfig
from dapo_megatron.launch_env import launch_env
from dapo_megatron.platform import destroy_distributed
from dapo_megatron.rank_zero import run_on_rank0
from dapo_megatron.run.console import CONSOLE_LOG, continue_in
from dapo_megatron.run.directory import claim_run_directory, existing_run
from dapo_megatron.run.model_source import prepare_initial_model
from dapo_megatron.run.restarts import RestartRecord, check_restart_limit
from dapo_megatron.run.stop_signals import STOPPED_EXIT_CODE, StopSignals
from dapo_megatron.run.watchdog import RankActivity, job_watchdog
from dapo_megatron.trainer.loop import DAPOTrainer


def run(args: argparse.Namespace, config: DAPOConfig) -> int:
    # Every rank's output goes on in the run directory if its reader (`| tee`) dies — a restarted one's from its
    # first line (rank 1 names a stopped rank 0, say); only rank 0's did, and only once its trainer was built.
    continue_in(Path(config.trainer.run_dir) / CONSOLE_LOG)
    with StopSignals() as stop:
        layout = init_process_layout(config)
        backend = layout.backend
        activity = RankActivity(layout.rank)
        watchdog = (job_watchdog(activity, timeout_s=config.parallel.collective_timeout_s,
                                 run_dir=config.trainer.run_dir) if config.parallel.watchdog else None)
        if watchdog is not None:
            watchdog.start()
        lock = None
        try:
            resume, overwrite, restart = continuation(args, config)
            lock = run_on_rank0(lambda: claim_run_directory(config.trainer.run_dir, resume=resume,
                                                            overwrite=overwrite),
                                what="claiming the run directory", broadcast_result=False)
            check_inputs(config, backend, resume=resume)
            model_dir = prepare_initial_model(config)  # model.source = tiny: rank 0 makes it (once), the others wait
            trainer = DAPOTrainer(config, model_dir, backend, resume=resume, stop=stop, activity=activity,
                                  restart=restart)
            try:
                result = trainer.run()
            finally:
                with activity.in_stage("shutdown"):
                    trainer.shutdown()
        finally:
            try:
                if watchdog is not None:
                    watchdog.stop()  # before the process group: under srun rank 0's process hosts the store
                destroy_distributed()
            finally:
                if lock is not None:
                    lock.release()
    run_dir = Path(config.trainer.run_dir).resolve()
    if layout.rank == 0:
        if result["stopped_by"]:
            print(f"stopped by {result['stopped_by']} after step {result['steps']}; `--resume` continues from its "
                  f"checkpoint")
        else:
            line = accuracy_line(result["first_eval"], result["last_eval"])
            if line:
                print(line)
        print(f"run directory: {run_dir}")
    return STOPPED_EXIT_CODE if result["stopped_by"] else 0


def continuation(args: argparse.Namespace, config: DAPOConfig) -> tuple[bool, bool, RestartRecord | None]:
    """``(resume, overwrite, restart record)`` of this start, on every rank. A launcher's restart (torchrun
    ``--max-restarts``, a requeued SLURM job) or ``trainer.auto_resume`` continues the run the directory holds, if any,
    and records the restart on rank 0; a restart never moves the run aside, even when the first launch had
    ``--overwrite``. A launcher's restart past ``trainer.max_restarts`` is refused."""
    env, run_dir = launch_env(), config.trainer.run_dir
    restarted = env.restart_count > 0
    if restarted:
        check_restart_limit(env, config.trainer.max_restarts, run_dir)
    if args.resume or not (restarted or config.trainer.auto_resume) or (args.overwrite and not restarted):
        return args.resume, args.overwrite, None
    resume = run_on_rank0(lambda: existing_run(run_dir) is not None, what="looking for the run to continue")
    restart = None
    if (resume or restarted) and env.rank == 0:
        restart = RestartRecord.before_resume(run_dir, env)
    return resume, False, restart


def accuracy_line(first: dict, last: dict) -> str | None:
    keys = sorted(k for k in last if k.startswith("val/all/acc/mean@"))
    if not keys:
        return None
    key = keys[0]
    return f"held-out accuracy: before={first.get(key, float('nan')):.4f} after={last[key]:.4f}"
