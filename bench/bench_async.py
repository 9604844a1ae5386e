"""Sync vs async rollouts, side by side, on the tiny SGLang example with the server on one core and the trainer on
the other (``taskset``): wall time per step, its ratio, and held-out accuracy after the same number of steps.

    python bench/bench_async.py [--steps 60] [--out runs/bench_async] [--server-core 0] [--trainer-core 1]
                                [--initial DIR] [--modes sync,async] [--set dotted.key=value ...]

1. The initial model is made once: ``dapo-megatron prepare-tiny examples/tiny_cpu_sglang.yaml`` (the CPU demo's
   warm-started model) into ``OUT/initial_model``, unless ``--initial`` names one. Both runs load it
   (``model.source=hf``), so they start from the same weights and tokenizer.
2. Each mode is one ``dapo-megatron train examples/tiny_cpu_sglang.yaml`` subprocess under
   ``taskset -c TRAINER_CORE`` with ``OMP_NUM_THREADS=1``; its SGLang server is launched through a two-line
   interpreter wrapper (``rollout.sglang.python``) that runs it under ``taskset -c SERVER_CORE``, so the server and
   every process and thread it starts stay on that core. ``sync`` is the default recipe; ``async`` adds
   ``rollout.mode=async rollout.max_staleness=1 algorithm.rollout_correction=token_tis`` (one step off-policy, token
   TIS: ``examples/tiny_cpu_async.yaml``'s settings).
3. Per mode, from its ``metrics.jsonl``: the mean wall time of a step (``timing_s/step``, steps 2..N: step 1 of the
   async run has nothing generated ahead yet), the time the trainer waited for rollouts (``timing_s/gen``), CPU
   seconds of the trainer process per step, and held-out greedy accuracy (``val/all/acc/mean@1``) at step 0 and
   step N. ``OUT/bench_async.md`` holds the table and the commands, ``OUT/summary.json`` the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_cpu_sglang.yaml"
MODE_OVERRIDES = {
    "sync": [],
    "async": ["rollout.mode=async", "rollout.max_staleness=1", "algorithm.rollout_correction=token_tis"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_async")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--initial", type=Path, help="an HF folder to start from instead of preparing one")
    parser.add_argument("--modes", default="sync,async", help="comma-separated: sync, async")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    unknown = [m for m in args.modes if m not in MODE_OVERRIDES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; expected from {list(MODE_OVERRIDES)}")
    return args


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def cli(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "dapo_megatron.cli", *arguments]


def pinned(core: int, command: list[str]) -> list[str]:
    return ["taskset", "-c", str(core), *command]


def server_python_wrapper(out: Path, core: int) -> Path:
    """An interpreter that runs SGLang on ``core``: every process and thread of the server inherits the mask."""
    wrapper = out / f"sglang_python_core{core}.sh"
    wrapper.write_text(f"#!/bin/sh\nexec taskset -c {core} {shlex.quote(sys.executable)} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def run_logged(command: list[str], log: Path) -> float:
    """Run ``command`` with its output in ``log``; its wall seconds. Raises with the log's tail if it fails."""
    started = time.perf_counter()
    with log.open("w") as handle:
        handle.write(shlex.join(command) + "\n")
        handle.flush()
        code = subprocess.run(command, cwd=REPO, env=env(), stdout=handle, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"{shlex.join(command)} failed ({code}); the end of {log}:\n{tail}")
    return time.perf_counter() - started


def mode_summary(run_dir: Path, steps: int, wall_s: float) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {row["step"]: row for row in rows}
    timed = [by_step[s] for s in range(2, steps + 1)]

    def mean(key: str) -> float:
        return sum(row.get(key, 0.0) for row in timed) / len(timed)

    return {
        "step_s": mean("timing_s/step"), "gen_wait_s": mean("timing_s/gen"), "train_cpu_s": mean("timing_cpu_s/step"),
        "acc_start": by_step[0].get("val/all/acc/mean@1"), "acc_end": by_step[steps].get("val/all/acc/mean@1"),
        "staleness_mean": mean("rollout/staleness/mean"), "run_wall_s": wall_s,
    }


def table(summary: dict, steps: int) -> str:
    lines = ["| mode | wall s / step (steps 2–N) | waiting for rollouts s / step | trainer CPU s / step | "
             f"held-out acc step 0 → {steps} | mean staleness | whole run s |", "|---|---|---|---|---|---|---|"]
    for mode, s in summary["modes"].items():
        lines.append(f"| {mode} | {s['step_s']:.2f} | {s['gen_wait_s']:.2f} | {s['train_cpu_s']:.2f} | "
                     f"{s['acc_start']:.3f} → {s['acc_end']:.3f} | {s['staleness_mean']:.2f} | "
                     f"{s['run_wall_s']:.0f} |")
    if "speedup" in summary:
        lines.append(f"\nsync / async wall time per step: **{summary['speedup']:.2f}×**")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    initial = args.initial.resolve() if args.initial else out / "initial_model"
    if not args.initial and not (initial / "COMPLETE").exists():
        run_logged(pinned(args.trainer_core, cli("prepare-tiny", str(EXAMPLE), "--out", str(initial), *args.set)),
                   out / "prepare.log")
    wrapper = server_python_wrapper(out, args.server_core)
    summary: dict = {"steps": args.steps, "server_core": args.server_core, "trainer_core": args.trainer_core,
                     "commands": {}, "modes": {}}
    for mode in args.modes:
        run_dir = out / mode
        command = pinned(args.trainer_core, cli(
            "train", str(EXAMPLE), "model.source=hf", f"model.hf_path={initial}", "warm_start.enabled=false",
            f"trainer.total_steps={args.steps}", f"trainer.run_dir={run_dir}", f"rollout.sglang.python={wrapper}",
            "rollout.sglang.base_port=0", "trainer.save_every=0", *MODE_OVERRIDES[mode], *args.set))
        print(f"[bench_async] {mode}: {shlex.join(command)}", flush=True)
        summary["commands"][mode] = shlex.join(command)
        wall_s = run_logged(command, out / f"{mode}.log")
        summary["modes"][mode] = mode_summary(run_dir, args.steps, wall_s)
        print(f"[bench_async] {mode}: {summary['modes'][mode]}", flush=True)
    if {"sync", "async"} <= set(summary["modes"]):
        summary["speedup"] = summary["modes"]["sync"]["step_s"] / summary["modes"]["async"]["step_s"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    report = table(summary, args.steps)
    commands = "\n".join(f"    {mode}: {cmd}" for mode, cmd in summary["commands"].items())
    (out / "bench_async.md").write_text(f"{report}\n\nCommands:\n\n{commands}\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
