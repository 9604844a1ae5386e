"""``dapo-megatron`` — prepare the demo model, train, evaluate, plot.

    dapo-megatron prepare-tiny CONFIG.yaml [dotted.key=value ...] [--out DIR]
    dapo-megatron train        CONFIG.yaml [dotted.key=value ...] [--resume | --overwrite]
    dapo-megatron eval         CONFIG.yaml --ckpt RUN/checkpoints/step_000012 [dotted.key=value ...] [--out FILE]
    dapo-megatron plot         RUN_DIR [--out FILE.png]
    dapo-megatron plan         CONFIG.yaml [dotted.key=value ...] [--data-parallel N] [--gpu-memory-gb GB]

``prepare-tiny`` builds the CPU demo's model (``model.source = tiny``) as an HF folder, by default where ``train``
looks for it (``<run_dir>/initial_model``); ``train`` prepares it itself when it is missing, so one command does it
all. ``train`` and ``eval`` run as one process, or under torchrun / srun for many (the layout comes from the
environment; see dapo_megatron.launch_env). ``plan`` prints the training ranks' GPU memory per pipeline stage for a
config (dapo_megatron.policy.memory.gpu) and exits 1 when a stage does not fit.

``train`` holds its run directory's lock while it runs, and refuses a directory that holds a run unless ``--resume``
continues it or ``--overwrite`` moves it aside (dapo_megatron.run.directory). SIGTERM, SIGUSR1 or SIGHUP make
it save a checkpoint at the end of the step in progress and exit 75; Ctrl-C ends it at once with 130
(dapo_megatron.run.stop_signals); a dead stdout (``| tee`` killed with it) stops nothing (dapo_megatron.run.console).

Bad input (a config key, a data file, a model folder, a checkpoint, a server) ends a command with one line on rank 0,
``<kind> error: <message>``, and the kind's exit code on every rank (dapo_megatron.user_errors); ``train`` and
``eval`` check what they read before building anything (dapo_megatron.run.input_checks).

Each command is a module of dapo_megatron.commands, imported only to run it, after its config has loaded: a config
error is answered before torch and megatron-core load.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from dapo_megatron.config import load_config
from dapo_megatron.launch_env import launch_env
from dapo_megatron.overrides.megatron_core.transformer_engine_import import hold_back_broken_transformer_engine
from dapo_megatron.run.stop_signals import INTERRUPTED_EXIT_CODE, StopNow
from dapo_megatron.user_errors import UserError


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    from dapo_megatron.overrides.megatron_core.log_levels import quiet_megatron_loggers

    quiet_megatron_loggers()


def _rank_from_env() -> int:
    return launch_env().rank


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dapo-megatron", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prepare = sub.add_parser("prepare-tiny", help="build (and warm-start) the CPU demo's model as an HF folder")
    prepare.add_argument("config")
    prepare.add_argument("overrides", nargs="*", help="dotted.key=value")
    prepare.add_argument("--out", default=None, help="folder to write (default: <trainer.run_dir>/initial_model, "
                                                     "where `train` looks for it)")
    prepare.set_defaults(command_module="prepare_tiny")
    train = sub.add_parser("train", help="run DAPO training")
    train.add_argument("config")
    train.add_argument("overrides", nargs="*", help="dotted.key=value")
    train.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    train.add_argument("--overwrite", action="store_true",
                       help="start a new run in a trainer.run_dir that holds one, moving the old run aside to "
                            "<run_dir>.replaced-<time>")
    train.set_defaults(command_module="train")
    evaluate = sub.add_parser("eval", help="evaluate a checkpoint (avg@k on the validation data)")
    evaluate.add_argument("config")
    evaluate.add_argument("overrides", nargs="*", help="dotted.key=value")
    evaluate.add_argument("--ckpt", required=True)
    evaluate.add_argument("--out", default=None, help="also write the metrics to this JSON file")
    evaluate.set_defaults(command_module="evaluate")
    plot = sub.add_parser("plot", help="PNG of reward, accuracy, entropy and response length")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None)
    plot.set_defaults(command_module="plot")
    plan = sub.add_parser("plan", help="GPU memory per pipeline stage of the training ranks, before a launch")
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*", help="dotted.key=value")
    plan.add_argument("--data-parallel", type=int, default=None, help="DP size (default: parallel.data, else 1)")
    plan.add_argument("--gpu-memory-gb", type=float, default=None,
                      help="memory of one GPU, in 10^9 bytes (default: parallel.gpu_memory_gb, else 80)")
    plan.add_argument("--host-memory-gb", type=float, default=None,
                      help="host memory of one node, in 10^9 bytes (default: parallel.host_memory_gb, else 1000)")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="trainer ranks on one node (default: 8)")
    plan.add_argument("--local-spec", action="store_true",
                      help="plan megatron's local spec (no Transformer Engine: unfused attention, no sequence "
                           "parallelism) instead of the TE path")
    plan.set_defaults(command_module="plan")
    return parser


# The commands that run as processes of a (possibly multi-rank) job and log as their rank.
LOGGING_COMMANDS = ("prepare-tiny", "train", "eval")


def run_command(args: argparse.Namespace) -> int:
    """Load the config (when the command takes one), then import the command's module and run it. Before that
    import loads megatron-core, a Transformer Engine that is installed but does not load is held back, so megatron
    takes it as absent and the backend's choice names its error (overrides/megatron_core/transformer_engine_import)."""
    config = load_config(args.config, args.overrides) if "config" in args else None
    hold_back_broken_transformer_engine()
    command = importlib.import_module(f"dapo_megatron.commands.{args.command_module}")
    if args.command in LOGGING_COMMANDS:
        _setup_logging(_rank_from_env())
    return command.run(args, config)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse ends a nargs="*" positional at the first option: `train C.yaml --resume key=value` left key=value
    # over. Overrides are accepted on either side of the options, as the synopsis shows them.
    if extra and hasattr(args, "overrides") and not any(arg.startswith("-") for arg in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return run_command(args)
    except UserError as exc:
        if _rank_for_messages() == 0:
            print(_with_where(exc.line(), exc), file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        if _rank_for_messages() == 0:
            print(f"interrupted (Ctrl-C){_what_resume_continues(args)}", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT_CODE
    except StopNow as stop:
        if _rank_for_messages() == 0:
            print(f"{stop}{_what_resume_continues(args)}", file=sys.stderr, flush=True)
        return stop.exit_code


def _with_where(line: str, error: BaseException) -> str:
    """``line`` with where the error happened appended to its first line — the rank, step and stage a training stage
    noted on its way out (dapo_megatron.run.watchdog.RankActivity) — when it says."""
    where = getattr(error, "dapo_where", None)
    if not where:
        return line
    first, newline, details = line.partition("\n")
    return f"{first} ({where}){newline}{details}"


def _what_resume_continues(args: argparse.Namespace) -> str:
    if args.command != "train":
        return ""
    from dapo_megatron.checkpoint import latest_checkpoint  # a stopped train run has loaded it: no cost here

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
