"""The DAPO ablation ladder (``examples/ablation/``, the paper's Table 1) as a benchmark: every rung × S seeds from
ONE warm-started tiny model, then a markdown table and a PNG of held-out accuracy.

    python bench/ablation.py [--ladder examples/ablation/scratchpad] [--seeds 3] [--steps 60] [--rungs 0,1,2,3,4,5]
                             [--eval-every 5]
                             [--out runs/ablation_ladder] [--eval-problems N] [--table-steps 0,20,40,60]
                             [--set dotted.key=value ...]

1. The initial model is made once (:func:`make_initial_model`): ``dapo-megatron prepare-tiny`` with the first rung's
   config warm-starts the tiny model into ``OUT/initial/initial_model``, an ordinary HF folder with its tokenizer.
2. Every rung and seed is a ``dapo-megatron train`` subprocess (the public CLI, so this keeps working while the
   trainer's insides change) into ``OUT/runs/<rung>/seed<k>``, loading that folder (``model.source=hf``, warm-start
   off) — the same weights and tokenizer the tiny path trains on (checked: identical metrics for 3 steps).
   Seed k sets ``trainer.seed = 1000·k``. With ``model.source=hf`` that seed moves only the prompt order, the
   rollout sampling and the mini-batch shuffle: every weight is loaded from the folder (megatron's random init is
   overwritten, vocab padding rows are zeroed, dropout is 0) and ``data.synthetic.seed`` — the problems — stays
   fixed. The stride 1000 keeps data orders apart: the sampler shuffles epoch e with ``seed + e``, so seeds 0 and 1
   would share an epoch order.
3. ``OUT/ablation.md`` (the tables and, per technique, whether its effect exceeds seed noise), ``OUT/ablation.png``
   (held-out accuracy), ``OUT/ablation_curves.png`` (entropy, response length, truncation, clipped tokens) and
   ``OUT/summary.json`` are written.

Resuming: a run with ``ablation_done.json`` in its directory is skipped; one that started but did not finish is
continued with ``--resume``, which replays exactly from its last checkpoint
(``tests/integration/test_trainer_resume.py``), so an interruption costs at most ``trainer.save_every`` steps of one
run instead of the whole run. The settings that decide what a run is (steps, evaluation, ``--set`` overrides) are
kept in ``OUT/ablation.json``; another call on the same ``OUT`` must agree with them (it may add seeds or rungs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import ablation_dynamics as dynamics
import ablation_report as report

REPO = Path(__file__).resolve().parents[1]
LADDER_DIR = REPO / "examples" / "ablation"
BASE_CONFIG = "base.yaml"
DONE_MARKER = "ablation_done.json"
SETTINGS_FILE = "ablation.json"
SEED_STRIDE = 1000
# Keys this tool sets itself; --set may not touch them (the flag to use instead, or why).
MANAGED_KEYS = {"trainer.run_dir": "--out", "trainer.seed": "--seeds", "trainer.total_steps": "--steps",
                "eval.every": "--eval-every", "eval.max_problems": "--eval-problems",
                "model.source": "every run loads the initial model",
                "model.hf_path": "every run loads the initial model",
                "warm_start.enabled": "the initial model is warm-started once"}


class AblationError(RuntimeError):
    """A bad flag, a run that failed, or an output folder made with other settings; the message says which."""


@dataclass(frozen=True)
class Rung:
    index: int
    name: str  # the config's file stem, e.g. 2_clip_higher
    config: Path


def discover_rungs(ladder_dir: Path = LADDER_DIR) -> list[Rung]:
    """The rungs of a ladder folder: its ``<number>_<name>.yaml`` files; a ``base.yaml`` there is the configuration
    the rungs start from, not a rung."""
    rungs = []
    for path in sorted(ladder_dir.glob("*.yaml")):
        if path.name == BASE_CONFIG:
            continue
        prefix = path.stem.split("_", 1)[0]
        if not prefix.isdigit():
            raise AblationError(f"{path}: a rung's file name must start with its number, e.g. 0_naive_grpo.yaml")
        rungs.append(Rung(int(prefix), path.stem, path))
    if not rungs:
        raise AblationError(f"no rung configs (*.yaml) in {ladder_dir}")
    return sorted(rungs, key=lambda r: r.index)


def select_rungs(rungs: list[Rung], spec: str | None) -> list[Rung]:
    """``spec``: rung numbers, comma-separated ("0,5"); None: all."""
    if spec is None:
        return rungs
    by_index = {r.index: r for r in rungs}
    try:
        wanted = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise AblationError(f"--rungs {spec!r}: expected rung numbers like 0,2,5") from None
    unknown = [i for i in wanted if i not in by_index]
    if unknown or not wanted:
        raise AblationError(f"--rungs {spec!r}: no rung {unknown or '(empty)'}; the ladder has {sorted(by_index)}")
    return [by_index[i] for i in sorted(set(wanted))]


def run_state(run_dir: Path) -> str:
    """"done" (the marker is there: skip it), "partial" (started: resume it) or "new"."""
    if (run_dir / DONE_MARKER).is_file():
        return "done"
    return "partial" if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists() else "new"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _last_logged_step(run_dir: Path) -> int:
    """The newest step in metrics.jsonl, tolerating a line that is still being written."""
    try:
        lines = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def train(config: Path, overrides: list[str], run_dir: Path, *, resume: bool, on_step=None) -> float:
    """One ``dapo-megatron train`` subprocess; its output goes to ``run_dir/train.log``. ``on_step(step)`` is
    called as metrics.jsonl grows. Returns the wall seconds; raises AblationError with the log's tail on failure."""
    return run_cli(["train", str(config), *overrides, f"trainer.run_dir={run_dir}", *(["--resume"] if resume else [])],
                   run_dir, on_step=on_step)


def run_cli(arguments: list[str], run_dir: Path, *, on_step=None) -> float:
    """``dapo-megatron <arguments>`` in a subprocess logging to ``run_dir/train.log`` (see :func:`train`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "dapo_megatron.cli", *arguments]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    log_path = run_dir / "train.log"
    start = time.monotonic()
    with log_path.open("a") as log:
        log.write(f"\n=== {datetime.now().isoformat(timespec='seconds')} {shlex.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=REPO, env=env)
        try:
            seen = -1
            while proc.poll() is None:
                time.sleep(1.0)
                step = _last_logged_step(run_dir)
                if on_step and step != seen:
                    on_step(step)
                    seen = step
        finally:  # interrupted (Ctrl-C, SIGTERM): leave no training process behind; the next call resumes it
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        raise AblationError(f"{shlex.join(command)}\nexited with {proc.returncode}; end of {log_path}:\n{tail}")
    return time.monotonic() - start


def make_initial_model(base_config: Path, out: Path, overrides: list[str]) -> Path:
    """The warm-started tiny model every rung and seed starts from, made once into ``OUT/initial/initial_model``
    by ``dapo-megatron prepare-tiny`` (an HF folder with its tokenizer, renamed into place when complete)."""
    run_dir = out / "initial"
    model_dir = run_dir / "initial_model"
    if not (model_dir / "config.json").is_file():
        print(f"[ablation] warm-starting the tiny model once ({base_config.name}) into {model_dir} ...", flush=True)
        seconds = run_cli(["prepare-tiny", str(base_config), *overrides, "--out", str(model_dir)], run_dir)
        if not (model_dir / "config.json").is_file():
            raise AblationError(f"prepare-tiny into {model_dir} wrote no config.json (see {run_dir / 'train.log'})")
        _write_atomically(run_dir / DONE_MARKER, json.dumps({"wall_s": seconds}) + "\n")
    return model_dir


def _ladder_name(ladder: Path) -> str:
    return str(ladder.relative_to(REPO)) if ladder.is_relative_to(REPO) else str(ladder)


def check_settings(out: Path, settings: dict) -> None:
    """Record what the runs under ``out`` are, or insist that this call asks for the same."""
    path = out / SETTINGS_FILE
    if path.exists():
        # Folders made before --ladder existed hold runs of the default ladder.
        saved = {"ladder": _ladder_name(LADDER_DIR), **json.loads(path.read_text())}
        for key, value in settings.items():
            if saved.get(key) != value:
                raise AblationError(f"{out} holds runs made with {key}={saved.get(key)!r}, this call asks for "
                                    f"{value!r}: use another --out, or delete {out} to start over")
        return
    out.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, json.dumps(settings, indent=2) + "\n")


class Progress:
    """Which run, its step, and the ladder's ETA from the seconds per step measured in this invocation."""

    def __init__(self, total_steps: int, finished_steps: int):
        self.total_steps, self.finished_steps = total_steps, finished_steps
        self.seconds_here, self.trained_here = 0.0, 0  # this invocation's training runs
        self.label, self.run_steps, self.started, self.last_print = "", 0, 0.0, 0.0
        self.first_step: int | None = None  # where this invocation picked the current run up
        self.current: int | None = None

    def start_run(self, label: str, run_steps: int) -> None:
        self.label, self.run_steps = label, run_steps
        self.first_step = self.current = None
        self.started = time.monotonic()

    def on_step(self, step: int) -> None:
        # A resumed run shows its old last step until the trainer cuts metrics.jsonl back to the checkpoint.
        self.first_step = step if self.first_step is None else min(self.first_step, step)
        self.current = step
        now = time.monotonic()
        if now - self.last_print >= 15 or step == self.run_steps:
            self.last_print = now
            print(f"[ablation] {self.label}: step {step}/{self.run_steps} | {self._ladder_line(now)}", flush=True)

    def finish_run(self, seconds: float) -> None:
        self.seconds_here += seconds
        self.trained_here += self.run_steps - (self.first_step or 0)
        self.finished_steps += self.run_steps
        self.first_step = self.current = None

    def _ladder_line(self, now: float) -> str:
        in_run = (self.current or 0) - (self.first_step or 0)
        done = self.finished_steps + (self.current or 0)
        trained, seconds = self.trained_here + in_run, self.seconds_here + (now - self.started)
        if not trained:
            return f"ladder {done}/{self.total_steps} steps | ETA after the first step"
        rate = seconds / trained
        return (f"ladder {done}/{self.total_steps} steps | {rate:.1f} s/step with start-up and evaluation | "
                f"ETA {rate * (self.total_steps - done) / 60:.0f} min")


NOTES = """\
acc @N: greedy held-out accuracy after N steps, mean ± std over seeds. best: the highest point of the seed-mean
curve. final − rung 0: difference of final mean accuracies, and in standard errors of that difference (|SE| < 2:
within seed noise). steps / samples to X: the first evaluated step at which the seed-mean accuracy reaches rung 0's
final mean X, and the training samples generated up to it (the resolution is the evaluation interval).
samples/step: responses generated per training step, × rung 0. truncated: responses cut at the length limit (the
only ones overlong filtering and the soft punishment act on). groups filtered: the fraction of generated groups
dynamic sampling dropped. groups w/o signal: all responses right or all wrong (zero advantage), with or without
dynamic sampling. s/step: training seconds per step (generation, old log-probs, updates, weight handoff)."""


def write_report(out: Path, rungs: list[Rung], seeds: list[int], table_steps: list[int], header: str) -> str:
    """Tables + PNG + summary.json from the runs' metrics; returns the markdown."""
    summaries, every_run = [], []
    for rung in rungs:
        runs = [report.SeedRun(seed, report.read_rows(out / "runs" / rung.name / f"seed{seed}" / "metrics.jsonl"))
                for seed in seeds]
        every_run += runs
        summaries.append(report.summarize_rung(rung.name, runs))
    baseline = next((s for s, r in zip(summaries, rungs) if r.index == 0), None)
    spread = report.step_zero_spread(every_run)
    if spread is None:
        start_check = "no run has a step-0 evaluation"
    elif spread == 0:
        start_check = "every run's step-0 accuracy is identical (they start from the same model)"
    else:
        start_check = (f"WARNING: step-0 accuracy differs by {spread:.4f} between runs: they did not start from the "
                       "same model")
    tmp_png = out / "ablation.tmp.png"
    report.plot_curves(summaries, tmp_png, target=baseline.final.mean if baseline else None)
    tmp_png.replace(out / "ablation.png")
    symmetric = [rung.name for rung in rungs if dynamics.symmetric_clip(out / "runs" / rung.name / f"seed{seeds[0]}")]
    dynamics.plot_dynamics(summaries, tmp_png, symmetric_clip=symmetric)
    tmp_png.replace(out / "ablation_curves.png")
    verdicts = dynamics.technique_verdicts(summaries)
    markdown = "\n\n".join([
        header, f"Check: {start_check}.", report.format_tables(summaries, table_steps, baseline), NOTES,
        "![held-out accuracy of every rung](ablation.png)", dynamics.format_dynamics_table(summaries),
        dynamics.DYNAMICS_NOTES,
        "![entropy, response length, truncation and clipped tokens of every rung](ablation_curves.png)",
        *([f"Each technique against the rung before it (|difference| >= {dynamics.NOISE_SE:g} standard errors of the "
           f"difference: beyond seed noise):\n\n{verdicts}"] if verdicts else [])]) + "\n"
    _write_atomically(out / "ablation.md", markdown)
    _write_atomically(out / "summary.json", json.dumps([asdict(s) for s in summaries], indent=2) + "\n")
    return markdown


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ladder", type=Path, default=LADDER_DIR,
                        help="the folder of rung configs (default: examples/ablation, the default task; "
                             "examples/ablation/scratchpad: the scratchpad task, with GSPO and CISPO rows)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per rung: 0..N-1 (trainer.seed = 1000·k)")
    parser.add_argument("--steps", type=int, default=60, help="RL steps per run")
    parser.add_argument("--rungs", default=None, help="rung numbers, comma-separated (default: all)")
    parser.add_argument("--eval-every", type=int, default=5, help="held-out evaluation interval in steps")
    parser.add_argument("--eval-problems", type=int, default=None, help="evaluate on the first N held-out problems")
    parser.add_argument("--table-steps", default=None,
                        help="accuracy columns, e.g. 0,20,40,60 (default: 0, ⅓, ⅔ and the end)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "ablation_ladder",
                        help="output folder: the runs, ablation.md, ablation.png (default: runs/ablation_ladder)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run and the initial model (repeatable)")
    args = parser.parse_args(argv)
    for flag, value, low in (("--seeds", args.seeds, 1), ("--steps", args.steps, 1),
                             ("--eval-every", args.eval_every, 0), ("--eval-problems", args.eval_problems or 1, 1)):
        if value < low:
            raise AblationError(f"{flag} must be >= {low}, got {value}")
    for text in args.overrides:
        key = text.split("=", 1)[0].strip()
        if "=" not in text:
            raise AblationError(f"--set {text!r}: expected dotted.key=value")
        if key in MANAGED_KEYS:
            raise AblationError(f"--set {text!r}: {key} is set by this tool ({MANAGED_KEYS[key]})")
    evaluated = {0, args.steps, *(range(args.eval_every, args.steps, args.eval_every) if args.eval_every else ())}
    if args.table_steps is None:
        args.table_steps = report.default_table_steps(args.steps, args.eval_every)
    else:
        try:
            args.table_steps = sorted({int(s) for s in args.table_steps.split(",") if s.strip()})
        except ValueError:
            raise AblationError(f"--table-steps {args.table_steps!r}: expected steps like 0,20,40,60") from None
        missing = [s for s in args.table_steps if s not in evaluated]
        if missing or not args.table_steps:
            raise AblationError(f"--table-steps: steps {missing} are not evaluated (0, every {args.eval_every}, "
                                f"and {args.steps})")
    args.out = args.out.resolve()
    args.ladder = args.ladder.resolve()
    if not args.ladder.is_dir():
        raise AblationError(f"--ladder {args.ladder}: not a folder of rung configs")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rungs = select_rungs(discover_rungs(args.ladder), args.rungs)
    seeds = list(range(args.seeds))
    eval_overrides = [f"eval.every={args.eval_every}"] + (
        [f"eval.max_problems={args.eval_problems}"] if args.eval_problems else [])
    check_settings(args.out, {"steps": args.steps, "eval_overrides": eval_overrides, "overrides": args.overrides,
                              "ladder": _ladder_name(args.ladder)})
    started = time.monotonic()
    initial_model = make_initial_model(rungs[0].config, args.out, [*args.overrides, *eval_overrides])

    plan = [(rung, seed, args.out / "runs" / rung.name / f"seed{seed}") for rung in rungs for seed in seeds]
    states = [run_state(run_dir) for _, _, run_dir in plan]
    progress = Progress(total_steps=args.steps * len(plan), finished_steps=args.steps * states.count("done"))
    print(f"[ablation] {len(plan)} runs ({len(rungs)} rungs × {len(seeds)} seeds × {args.steps} steps): "
          f"{states.count('done')} finished, {states.count('partial')} to resume, {states.count('new')} to start",
          flush=True)
    for number, ((rung, seed, run_dir), state) in enumerate(zip(plan, states), 1):
        label = f"run {number}/{len(plan)} {rung.name} seed {seed}"
        if state == "done":
            print(f"[ablation] {label}: finished earlier, skipped", flush=True)
            continue
        print(f"[ablation] {label}: {'resuming' if state == 'partial' else 'starting'} in {run_dir}", flush=True)
        progress.start_run(label, args.steps)
        overrides = [*args.overrides, *eval_overrides, "model.source=hf", f"model.hf_path={initial_model}",
                     "warm_start.enabled=false", f"trainer.seed={SEED_STRIDE * seed}",
                     f"trainer.total_steps={args.steps}"]
        seconds = train(rung.config, overrides, run_dir, resume=state == "partial", on_step=progress.on_step)
        if args.steps not in report.SeedRun(seed, report.read_rows(run_dir / "metrics.jsonl")).accuracy():
            raise AblationError(f"{run_dir}: the run exited cleanly but metrics.jsonl has no held-out accuracy at "
                                f"step {args.steps}")
        _write_atomically(run_dir / DONE_MARKER, json.dumps({"steps": args.steps, "wall_s": seconds,
                                                             "resumed": state == "partial"}) + "\n")
        progress.finish_run(seconds)

    wall = time.monotonic() - started
    markers = [args.out / "initial" / DONE_MARKER, *(run_dir / DONE_MARKER for _, _, run_dir in plan)]
    summed = sum(json.loads(m.read_text())["wall_s"] for m in markers if m.is_file())
    command = shlex.join(["python", "bench/ablation.py", *(sys.argv[1:] if argv is None else argv)])
    header = (f"## DAPO ablation ladder: {len(rungs)} rungs × {len(seeds)} seeds × {args.steps} steps\n\n"
              f"`{command}` — {datetime.now():%Y-%m-%d}, {os.cpu_count()} CPUs. Wall time: {summed / 60:.1f} min "
              f"(the initial model and every run, summed; a resumed run counts its last invocation), this "
              f"invocation {wall / 60:.1f} min ({states.count('done')} of {len(plan)} runs reused).")
    print(write_report(args.out, rungs, seeds, args.table_steps, header), flush=True)
    print(f"[ablation] wrote {args.out / 'ablation.md'} and {args.out / 'ablation.png'}", flush=True)
    return 0


if __name__ == "__main__":
    # SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C, so the running trainer is stopped too, not orphaned.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    try:
        sys.exit(main())
    except AblationError as exc:
        print(f"ablation: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("ablation: interrupted; the same command resumes where it stopped", file=sys.stderr)
        sys.exit(130)
