"""``dapo-megatron`` — prepare the demo model, train, evaluate, plot.

    dapo-megatron prepare-tiny CONFIG.yaml [dotted.key=value ...] [--out DIR]
    dapo-megatron train        CONFIG.yaml [dotted.key=value ...] [--resume | --overwrite]
    dapo-megatron eval         CONFIG.yaml --ckpt RUN/checkpoints/step_000012 [dotted.key=value ...] [--out FILE]
    dapo-megatron plot         RUN_DIR [--out FILE.png]
    dapo-megatron plan         CONFIG.yaml [dotted.key=value ...] [--data-parallel N] [--gpu-memory-gb 80]

``prepare-tiny`` builds the CPU demo's model (``model.source = tiny``) as an HF folder, by default where ``train``
looks for it (``<run_dir>/initial_model``); ``train`` prepares it itself when it is missing, so one command does it
all. ``train`` and ``eval`` run as one process, or under torchrun / srun for many (the layout comes from the
environment; see dapo_megatron.launch_env). ``plan`` prints the training ranks' GPU memory per pipeline stage for a
config (dapo_megatron.policy.memory) and exits 1 when a stage does not fit.

``train`` holds its run directory's lock while it runs, and refuses a directory that holds a run unless ``--resume``
continues it or ``--overwrite`` moves it aside (dapo_megatron.run.directory). SIGTERM or SIGUSR1 make it
save a checkpoint at the end of the step in progress and exit 75; Ctrl-C ends it at once with 130
(dapo_megatron.run.stop_signals).

Bad input (a config key, a data file, a model folder, a checkpoint, a server) ends a command with one line on rank 0,
``<kind> error: <message>``, and the kind's exit code on every rank (dapo_megatron.user_errors); ``train`` and
``eval`` check what they read before building anything (dapo_megatron.run.input_checks).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from dapo_megatron.config import load_config
from dapo_megatron.run.stop_signals import INTERRUPTED_EXIT_CODE, STOPPED_EXIT_CODE, StopNow, StopSignals
from dapo_megatron.user_errors import UserError


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    # megatron-core logs every parameter name and its FSDP probing at INFO: keep its warnings only.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    # Its checkpoint writer logs a writer process's failure as an error line, then raises it: the raised error says it
    # (a full disk becomes one `checkpoint error:` line, dapo_megatron.checkpoint.save_load).
    logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async").setLevel(logging.CRITICAL)


def _rank_from_env() -> int:
    from dapo_megatron.launch_env import launch_env

    return launch_env().rank


def _check_inputs(config, backend, **what) -> None:
    """:func:`~dapo_megatron.run.input_checks.check_run_inputs` on rank 0; its error is raised on every rank."""
    import torch.distributed as dist

    from dapo_megatron.rank_zero import run_on_rank0
    from dapo_megatron.run.input_checks import check_run_inputs

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    run_on_rank0(lambda: check_run_inputs(config, world_size=world_size, backend=backend, **what),
                 what="checking the inputs")


def _accuracy_line(first: dict, last: dict) -> str | None:
    keys = sorted(k for k in last if k.startswith("val/all/acc/mean@"))
    if not keys:
        return None
    key = keys[0]
    return f"held-out accuracy: before={first.get(key, float('nan')):.4f} after={last[key]:.4f}"


def _init_distributed(config):
    """The process layout, with the backend of this platform and ``model.kernels`` chosen once, here."""
    import os

    import torch

    from dapo_megatron.backend import select_backend
    from dapo_megatron.backend.platform import init_distributed
    from dapo_megatron.rollout.sglang.gpus import trainer_nccl_env

    os.environ.update(trainer_nccl_env(config, cuda_available=torch.cuda.is_available()))  # before any NCCL group
    p = config.parallel
    backend = select_backend(config.model.kernels)
    return init_distributed(p.tensor, p.pipeline, p.data, expert_parallel=p.expert, backend=backend,
                            timeout_s=p.collective_timeout_s)


def cmd_prepare_tiny(args: argparse.Namespace) -> int:
    from dapo_megatron.launch_env import LaunchError, launch_env
    from dapo_megatron.tiny_model import prepare_tiny_model
    from dapo_megatron.run.model_source import tiny_model_dir
    from dapo_megatron.run.lock import RunLock

    config = load_config(args.config, args.overrides)
    if launch_env().world_size > 1:
        raise LaunchError("prepare-tiny runs as one process (not under torchrun / srun with several tasks): "
                          "`train` prepares the model on rank 0 by itself")
    _setup_logging(0)
    if args.out is None:  # into the run directory: not while a run there may be making or reading it
        Path(config.trainer.run_dir).mkdir(parents=True, exist_ok=True)
        with RunLock(config.trainer.run_dir):
            out = prepare_tiny_model(config, tiny_model_dir(config))
    else:
        out = prepare_tiny_model(config, args.out)
    print(f"tiny model: {Path(out).resolve()}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)  # a config error in a blink, before torch and megatron load

    from dapo_megatron.backend.platform import destroy_distributed
    from dapo_megatron.rank_zero import run_on_rank0
    from dapo_megatron.trainer.loop import DAPOTrainer
    from dapo_megatron.run.model_source import prepare_initial_model
    from dapo_megatron.run.directory import claim_run_directory

    rank = _rank_from_env()
    _setup_logging(rank)
    with StopSignals() as stop:
        backend = _init_distributed(config).backend
        lock = None
        try:
            lock = run_on_rank0(lambda: claim_run_directory(config.trainer.run_dir, resume=args.resume,
                                                            overwrite=args.overwrite),
                                what="claiming the run directory", broadcast_result=False)
            _check_inputs(config, backend, resume=args.resume)
            model_dir = prepare_initial_model(config)  # model.source = tiny: rank 0 makes it (once), the others wait
            trainer = DAPOTrainer(config, model_dir, backend, resume=args.resume, stop=stop)
            try:
                result = trainer.run()
            finally:
                trainer.shutdown()
        finally:
            try:
                destroy_distributed()
            finally:
                if lock is not None:
                    lock.release()
    run_dir = Path(config.trainer.run_dir).resolve()
    if rank == 0:
        if result["stopped_by"]:
            print(f"stopped by {result['stopped_by']} after step {result['steps']}; `--resume` continues from its "
                  f"checkpoint")
        else:
            line = _accuracy_line(result["first_eval"], result["last_eval"])
            if line:
                print(line)
        print(f"run directory: {run_dir}")
    return STOPPED_EXIT_CODE if result["stopped_by"] else 0


def cmd_eval(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)  # as in cmd_train

    from dapo_megatron.backend.platform import destroy_distributed
    from dapo_megatron.trainer.evaluate import evaluate_checkpoint

    rank = _rank_from_env()
    _setup_logging(rank)
    backend = _init_distributed(config).backend
    try:
        _check_inputs(config, backend, checkpoint=args.ckpt)
        metrics = evaluate_checkpoint(config, args.ckpt, backend)
    finally:
        destroy_distributed()
    if rank == 0:
        for key, value in sorted(metrics.items()):
            print(f"{key}: {value:.4f}")
        if args.out:
            _write_json(Path(args.out), metrics)
    return 0


def _write_json(path: Path, data: dict) -> None:
    """Atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def cmd_plot(args: argparse.Namespace) -> int:
    from dapo_megatron.metrics.plot import plot_run

    out = plot_run(args.run_dir, args.out)
    print(f"wrote {out}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from dapo_megatron.policy.plan_report import plan_report
    from dapo_megatron.run.model_source import model_spec_for_plan

    config = load_config(args.config, args.overrides)
    spec, origin = model_spec_for_plan(config)
    report, fits = plan_report(config, spec, origin, data_parallel=args.data_parallel,
                               gpu_memory_gb=args.gpu_memory_gb, local_spec=args.local_spec)
    print(report)
    return 0 if fits else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dapo-megatron", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prepare = sub.add_parser("prepare-tiny", help="build (and warm-start) the CPU demo's model as an HF folder")
    prepare.add_argument("config")
    prepare.add_argument("overrides", nargs="*", help="dotted.key=value")
    prepare.add_argument("--out", default=None, help="folder to write (default: <trainer.run_dir>/initial_model, "
                                                     "where `train` looks for it)")
    prepare.set_defaults(func=cmd_prepare_tiny)
    train = sub.add_parser("train", help="run DAPO training")
    train.add_argument("config")
    train.add_argument("overrides", nargs="*", help="dotted.key=value")
    train.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    train.add_argument("--overwrite", action="store_true",
                       help="start a new run in a trainer.run_dir that holds one, moving the old run aside to "
                            "<run_dir>.replaced-<time>")
    train.set_defaults(func=cmd_train)
    evaluate = sub.add_parser("eval", help="evaluate a checkpoint (avg@k on the validation data)")
    evaluate.add_argument("config")
    evaluate.add_argument("overrides", nargs="*", help="dotted.key=value")
    evaluate.add_argument("--ckpt", required=True)
    evaluate.add_argument("--out", default=None, help="also write the metrics to this JSON file")
    evaluate.set_defaults(func=cmd_eval)
    plot = sub.add_parser("plot", help="PNG of reward, accuracy, entropy and response length")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None)
    plot.set_defaults(func=cmd_plot)
    plan = sub.add_parser("plan", help="GPU memory per pipeline stage of the training ranks, before a launch")
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*", help="dotted.key=value")
    plan.add_argument("--data-parallel", type=int, default=None, help="DP size (default: parallel.data, else 1)")
    plan.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU, in 10^9 bytes")
    plan.add_argument("--local-spec", action="store_true",
                      help="plan megatron's local spec (no Transformer Engine: unfused attention, no sequence "
                           "parallelism) instead of the TE path")
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        if _rank_for_messages() == 0:
            print(exc.line(), file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        if _rank_for_messages() == 0:
            print(f"interrupted (Ctrl-C){_what_resume_continues(args)}", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT_CODE
    except StopNow as stop:
        if _rank_for_messages() == 0:
            print(f"{stop}{_what_resume_continues(args)}", file=sys.stderr, flush=True)
        return stop.exit_code


def _what_resume_continues(args: argparse.Namespace) -> str:
    if args.command != "train":
        return ""
    from dapo_megatron.checkpoint import latest_checkpoint

    try:
        newest = latest_checkpoint(Path(load_config(args.config, args.overrides).trainer.run_dir) / "checkpoints")
    except UserError:
        return ""
    return f"; `--resume` continues from {newest}" if newest else "; no checkpoint was written yet"


def _rank_for_messages() -> int:
    try:
        return _rank_from_env()
    except UserError:  # the launch environment itself is the bad input: say it on every process
        return 0


if __name__ == "__main__":
    sys.exit(main())
