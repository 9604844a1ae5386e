"""``dapo-megatron`` — train, evaluate, plot.

    dapo-megatron train CONFIG.yaml [dotted.key=value ...] [--resume]
    dapo-megatron eval  CONFIG.yaml --ckpt RUN/checkpoints/step_000012 [dotted.key=value ...]
    dapo-megatron plot  RUN_DIR [--out FILE.png]

``train`` and ``eval`` run as one process, or under torchrun / srun for many (the layout comes from the
environment; see dapo_megatron.platform).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dapo_megatron.config import ConfigError, load_config


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    # megatron-core logs every parameter name and its FSDP probing at INFO: keep its warnings only.
    logging.getLogger("megatron").setLevel(logging.WARNING)


def _rank_from_env() -> int:
    from dapo_megatron.platform import launch_env

    return launch_env().rank


def _accuracy_line(first: dict, last: dict) -> str | None:
    keys = sorted(k for k in last if k.startswith("val/all/acc/mean@"))
    if not keys:
        return None
    key = keys[0]
    return f"held-out accuracy: before={first.get(key, float('nan')):.4f} after={last[key]:.4f}"


def cmd_train(args: argparse.Namespace) -> int:
    from dapo_megatron.platform import destroy_distributed
    from dapo_megatron.trainer.loop import DAPOTrainer

    config = load_config(args.config, args.overrides)
    rank = _rank_from_env()
    _setup_logging(rank)
    trainer = DAPOTrainer(config, resume=args.resume)
    try:
        result = trainer.run()
    finally:
        trainer.shutdown()
        destroy_distributed()
    if rank == 0:
        line = _accuracy_line(result["first_eval"], result["last_eval"])
        if line:
            print(line)
        print(f"run directory: {Path(config.trainer.run_dir).resolve()}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from dapo_megatron.checkpoint import MODEL_DIR, load_model
    from dapo_megatron.platform import destroy_distributed
    from dapo_megatron.trainer.loop import DAPOTrainer

    config = load_config(args.config, args.overrides)
    rank = _rank_from_env()
    _setup_logging(rank)
    model_dir = Path(args.ckpt) / MODEL_DIR
    if not model_dir.is_dir():
        raise SystemExit(f"--ckpt {args.ckpt}: no model/ folder (expected a trainer or checkpoint_tools checkpoint)")
    trainer = DAPOTrainer(config)
    try:
        load_model([trainer.actor.model], model_dir)
        trainer.hand_off_weights(version=1)
        metrics = trainer.validate()
    finally:
        trainer.shutdown()
        destroy_distributed()
    if rank == 0:
        for key, value in sorted(metrics.items()):
            print(f"{key}: {value:.4f}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from dapo_megatron.trainer.plot import plot_run

    out = plot_run(args.run_dir, args.out)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dapo-megatron", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run DAPO training")
    train.add_argument("config")
    train.add_argument("overrides", nargs="*", help="dotted.key=value")
    train.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    train.set_defaults(func=cmd_train)
    evaluate = sub.add_parser("eval", help="evaluate a checkpoint (avg@k on the validation data)")
    evaluate.add_argument("config")
    evaluate.add_argument("overrides", nargs="*", help="dotted.key=value")
    evaluate.add_argument("--ckpt", required=True)
    evaluate.set_defaults(func=cmd_eval)
    plot = sub.add_parser("plot", help="PNG of reward, accuracy, entropy and response length")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None)
    plot.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
