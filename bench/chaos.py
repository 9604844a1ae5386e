"""Chaos benchmark (issue 42.3): small DAPO jobs under ``torchrun --max-restarts`` with ``trainer.auto_resume=true``,
hit by faults at random moments, each healed by the restart loop or in place; what it cost, per kind of fault.

    python bench/chaos.py --short                       # the test command's form: 2 faults, one run + its baseline
    python bench/chaos.py --kinds all --runs 2 --faults 2 --out runs/chaos   # the long form (docs/reliability.md)

Kinds (``--kinds``, comma-separated or ``all``), each on the job it needs:

=============== ======= ============================================================================================
rank-kill/stop  trainer SIGKILL / SIGSTOP of a trainer rank (of 2, chosen at random)
reward-kill/stop trainer SIGKILL / SIGSTOP of a reward worker process (``reward.builtin_in_workers``)
disk-full       trainer the checkpoint folder's filesystem (a tmpfs: needs root) filled before a save; the filler is
                        removed once the failed attempt has ended (the space an operator or a cleanup frees)
sglang-kill/stop sglang SIGKILL / SIGSTOP of the SGLang server (disk transport: a server can be relaunched)
sglang-stop-handoff sglang SIGSTOP of the server the moment the step's weights are on disk for it: mid-handoff
sandbox-kill/stop tools SIGKILL / SIGSTOP of a running bubblewrap sandbox call (the tool-task model, warm-started)
=============== ======= ============================================================================================

Per fault: the step it is planned after (random, at least 3 steps apart, never in the last 2), a random delay within
the step, the victim; detection is the time from the signal until the processes it hit are gone and reaped — the
whole failed attempt for a rank or a full disk (its launcher saw it), the victim itself for a helper (its parent
noticed). Per job: a fault-free baseline of the same config. Per run: restarts (``restarts.jsonl``), steps lost
(trained again after a restart), steps trained twice (a step logged twice in the final ``metrics.jsonl``: 0 wanted),
and the final held-out accuracy (``val/all/acc/mean@1``, greedy) against the baseline's, within 2 standard errors of
their difference (binomial, ``data.synthetic.num_heldout`` problems) wanted.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import random
import shutil
import signal
import subprocess
import time
import zlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from chaos_run import REPO, JobRun, env, gone, read_jsonl

SMALL = ["trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
         "data.synthetic.num_train=400", "eval.every=0", "rollout.max_response_length=24",
         "algorithm.overlong_buffer_len=4", "algorithm.dynamic_sampling=false", "trainer.keep_checkpoints=2"]
# (each job's own overrides come after these and win)
TIMEOUT_S = 20.0  # parallel.collective_timeout_s of the jobs: a stopped rank is named this long after its last beat


@dataclass(frozen=True)
class Job:
    config: str
    ranks: int
    overrides: tuple[str, ...]
    prepare: str | None = None  # an example whose warm-started model the job starts from (long form)


JOBS = {
    "trainer": Job("examples/tiny_cpu.yaml", 2, ("reward.builtin_in_workers=true", "reward.num_workers=2",
                                                   "reward.timeout_s=10"), prepare="examples/tiny_cpu.yaml"),
    "sglang": Job("examples/tiny_cpu_sglang.yaml", 1, ("rollout.sglang.request_timeout_s=30",
                                                        "rollout.sglang.max_restarts=4"),
                  prepare="examples/tiny_cpu.yaml"),
    "tools": Job("examples/tiny_cpu_tools.yaml", 1, ("rollout.tools.sandbox.limits.wall_s=5",
                                                       "rollout.max_response_length=72",
                                                       "algorithm.overlong_buffer_len=8"),
                 prepare="examples/tiny_cpu_tools.yaml"),
}
KINDS = {"rank-kill": ("trainer", "rank", signal.SIGKILL), "rank-stop": ("trainer", "rank", signal.SIGSTOP),
         "reward-kill": ("trainer", "reward", signal.SIGKILL), "reward-stop": ("trainer", "reward", signal.SIGSTOP),
         "disk-full": ("trainer", "disk", None),
         "sglang-kill": ("sglang", "sglang", signal.SIGKILL), "sglang-stop": ("sglang", "sglang", signal.SIGSTOP),
         "sglang-stop-handoff": ("sglang", "sglang", signal.SIGSTOP),
         "sandbox-kill": ("tools", "sandbox", signal.SIGKILL), "sandbox-stop": ("tools", "sandbox", signal.SIGSTOP)}


@dataclass
class FaultResult:
    kind: str
    step: int  # planned after this step
    victim: str  # "rank 1 (pid 123)", ...
    detected_s: float | None  # None: not detected within the budget
    watchdog_line: str | None = None  # the watchdog's line, for a stopped rank


@dataclass
class RunResult:
    job: str
    run_dir: str
    exit_code: int
    wall_s: float
    faults: list[FaultResult] = field(default_factory=list)
    restarts: int = 0
    steps_lost: int = 0
    steps_twice: int = 0
    steps_differing: int | None = None  # steps whose metrics (clock readings aside) differ from the baseline's
    final_step: int | None = None
    accuracy: float | None = None
    leftovers: list[str] = field(default_factory=list)  # processes naming the run directory still alive at its end


# ------------------------------------------------------------------------------------------------------- one run

def job_overrides(job: Job, steps: int, heldout: int, initial: Path | None, save_every: int) -> list[str]:
    model = ["model.source=hf", f"model.hf_path={initial}"] if initial else [
        "warm_start.enabled=false", "model.tiny.hidden_size=32", "model.tiny.num_layers=2",
        "model.tiny.intermediate_size=64"]
    return [*SMALL, *job.overrides, *model, f"trainer.total_steps={steps}", f"trainer.save_every={save_every}",
            f"data.synthetic.num_heldout={heldout}", f"parallel.collective_timeout_s={TIMEOUT_S:g}"]


def run_job(name: str, run_dir: Path, overrides: list[str], kinds: list[str], *, steps: int, seed: int,
            dead_pipe: bool = False, stop_rank: int | None = None, budget_s: float = 1800) -> RunResult:
    """One run of job ``name`` with one fault of each of ``kinds`` (none: the baseline). ``dead_pipe``: stop reading
    the job's output at the first fault (its later lines must reach console.log); ``stop_rank``: the rank a rank
    fault hits (default: random)."""
    job, rng = JOBS[name], random.Random(seed)
    plan = sorted(zip(rng.sample(range(2, steps - 2, 3), len(kinds)), kinds)) if kinds else []
    for stale in (run_dir, run_dir.with_name(run_dir.name + ".log")):  # auto_resume would continue an old run
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    ballast = mount_tmpfs(run_dir) if "disk-full" in kinds else None
    run = JobRun(REPO / job.config, run_dir, overrides, ranks=job.ranks, restarts=len(kinds) + 1)
    result = RunResult(name, str(run_dir), exit_code=-1, wall_s=0.0)
    try:
        for step, kind in plan:
            run.wait_for_step(step, timeout_s=budget_s)
            time.sleep(rng.uniform(0.0, 0.5))
            if dead_pipe and not result.faults:
                run.close_output()
            result.faults.append(inject(run, kind, step, rng, stop_rank, ballast, budget_s))
        result.exit_code = run.wait(timeout_s=budget_s)
    except BaseException:
        run.kill()
        raise
    finally:
        if ballast is not None:
            subprocess.run(["umount", "-l", str(ballast.parent)], check=False)
    result.wall_s = time.monotonic() - run.started
    summarize(result, run_dir)
    time.sleep(2.0)  # what the launcher's teardown kills has gone by then
    result.leftovers = leftovers(run_dir)
    return result


def leftovers(run_dir: Path) -> list[str]:
    """Processes still alive whose command line names ``run_dir`` (a rank's, a checkpoint writer's, a server's)."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        line = " ".join(process.info["cmdline"] or [])
        if str(run_dir) in line and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(f"{process.info['pid']}: {line[:160]}")
    return found


def inject(run: JobRun, kind: str, step: int, rng: random.Random, stop_rank: int | None, ballast: Path | None,
           budget_s: float) -> FaultResult:
    _, part, signum = KINDS[kind]
    injected_at = time.time()
    if part == "disk":
        attempt = list(run.ranks().values())
        fill(ballast)
        start = time.monotonic()
        detected = wait_until(lambda: all(gone(p) for p in attempt), budget_s)
        ballast.unlink()  # the space comes back: the restart can save again
        return FaultResult(kind, step, "the checkpoint filesystem", time.monotonic() - start if detected else None)
    victim = find_victim(run, part, rng, stop_rank, budget_s)
    if kind == "sglang-stop-handoff":  # the disk transport's snapshot of the next version: the server loads it next
        snapshot = run.run_dir / "sglang" / "weights" / f"v{step + 1}"
        wait_until(snapshot.exists, budget_s)
    label = f"rank {victim.environ().get('RANK')}" if part == "rank" else part
    hit = list(run.ranks().values()) if part == "rank" else [victim]
    start = time.monotonic()
    victim.send_signal(signum)
    detected = wait_until(lambda: all(gone(p) for p in hit), budget_s)
    elapsed = time.monotonic() - start if detected else None
    line = next((row["line"] for row in read_jsonl(run.run_dir / "faults.jsonl")
                 if row["time"] >= _iso(injected_at)), None) if part == "rank" else None
    return FaultResult(kind, step, f"{label} (pid {victim.pid})", elapsed, line)


def find_victim(run: JobRun, part: str, rng: random.Random, stop_rank: int | None, budget_s: float):
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        if part == "rank":
            ranks = run.ranks()
            if ranks:
                return ranks[stop_rank if stop_rank is not None else rng.choice(sorted(ranks))]
        else:
            found = run.helpers(part)
            if found:
                return rng.choice(found)
        time.sleep(0.02)  # a sandbox call lives for a few milliseconds: look often
    raise TimeoutError(f"no {part} process to hit within {budget_s:.0f} s")


def wait_until(condition, budget_s: float) -> bool:
    deadline = time.monotonic() + budget_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def mount_tmpfs(run_dir: Path, size_mb: int = 96) -> Path:
    """``<run_dir>/checkpoints`` on a tmpfs of its own (root only); returns the filler file's path."""
    checkpoints = run_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(checkpoints)], check=True)
    return checkpoints / "filler"


def fill(ballast: Path) -> None:
    """Fill the filesystem of ``ballast`` but 64 KiB: the next checkpoint finds no room. A checkpoint being written
    meanwhile takes space after ``free`` was read: the filler then meets a full disk first, which is the aim."""
    free = shutil.disk_usage(ballast.parent).free - 64 * 1024
    with open(ballast, "wb") as file:
        file.truncate(0)
        block = b"\0" * 2**20
        try:
            while free > 0:
                free -= file.write(block[:min(len(block), free)])
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise


def summarize(result: RunResult, run_dir: Path) -> None:
    restarts = read_jsonl(run_dir / "restarts.jsonl")
    result.restarts = sum(1 for row in restarts if row.get("launcher_restart", 0) > 0)
    result.steps_lost = sum(row.get("steps_lost", 0) for row in restarts)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [row["step"] for row in rows]
    result.steps_twice = len(steps) - len(set(steps))
    result.final_step = max(steps, default=None)
    final = [row for row in rows if row["step"] == result.final_step and "val/all/acc/mean@1" in row]
    result.accuracy = final[-1]["val/all/acc/mean@1"] if final else None


CLOCK_READINGS = ("timing_s/", "timing_cpu_s/", "perf/")


def compare(run: RunResult, baseline: RunResult) -> None:
    """How many of ``run``'s logged steps differ from the fault-free run's (an exact resume: none)."""
    def rows(result: RunResult) -> dict[int, dict]:
        return {row["step"]: {k: v for k, v in row.items() if not k.startswith(CLOCK_READINGS)}
                for row in read_jsonl(Path(result.run_dir) / "metrics.jsonl")}

    mine, theirs = rows(run), rows(baseline)
    run.steps_differing = sum(mine.get(step) != theirs.get(step) for step in set(mine) | set(theirs))


def _iso(stamp: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(stamp, timezone.utc).isoformat(timespec="milliseconds")


# ------------------------------------------------------------------------------------------------------- report

def standard_error(accuracy: float, problems: int) -> float:
    return math.sqrt(max(accuracy * (1 - accuracy), 0.0) / problems)


def report(runs: list[RunResult], baselines: dict[str, RunResult], heldout: int) -> list[dict]:
    """One row per kind: faults, detection (mean and max), restarts, steps lost, steps trained twice, accuracy of
    its runs against their job's baseline."""
    by_kind: dict[str, list[tuple[RunResult, FaultResult]]] = defaultdict(list)
    for run in runs:
        for fault in run.faults:
            by_kind[fault.kind].append((run, fault))
    rows = []
    for kind, hits in by_kind.items():
        detected = [f.detected_s for _, f in hits if f.detected_s is not None]
        hit_runs = list({id(r): r for r, _ in hits}.values())
        base = baselines[hits[0][0].job].accuracy
        accs = [r.accuracy for r in hit_runs if r.accuracy is not None]
        worst = max((abs(a - base) / max(math.hypot(standard_error(a, heldout), standard_error(base, heldout)),
                                           1e-12) if a != base else 0.0) for a in accs) if accs and base is not None \
            else None
        rows.append({"kind": kind, "faults": len(hits), "undetected": len(hits) - len(detected),
                     "detected_mean_s": round(sum(detected) / len(detected), 1) if detected else None,
                     "detected_max_s": round(max(detected), 1) if detected else None,
                     "restarts": sum(r.restarts for r in hit_runs), "steps_lost": sum(r.steps_lost for r in hit_runs),
                     "steps_twice": sum(r.steps_twice for r in hit_runs),
                     "steps_differing": sum(r.steps_differing or 0 for r in hit_runs),
                     "completed": sum(r.exit_code == 0 for r in hit_runs), "runs": len(hit_runs),
                     "accuracy": [round(a, 3) for a in accs], "baseline_accuracy": base,
                     "worst_se": None if worst is None else round(worst, 2)})
    return rows


def markdown(rows: list[dict], heldout: int) -> str:
    lines = ["| fault | faults | detected: mean / max (s) | restarts | steps lost | trained twice | steps unlike "
             "fault-free | runs completed | final accuracy (fault-free) | worst diff / SE |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        detection = f"{r['detected_mean_s']} / {r['detected_max_s']}" + (
            f" ({r['undetected']} undetected)" if r["undetected"] else "")
        lines.append(f"| {r['kind']} | {r['faults']} | {detection} | {r['restarts']} | {r['steps_lost']} | "
                     f"{r['steps_twice']} | {r['steps_differing']} | {r['completed']}/{r['runs']} | "
                     f"{', '.join(f'{a:.3f}' for a in r['accuracy'])} ({r['baseline_accuracy']}) | {r['worst_se']} |")
    lines.append(f"\nAccuracy: greedy on {heldout} held-out problems; SE of a difference = "
                 f"hypot(SE_a, SE_b), SE = sqrt(p(1-p)/{heldout}).")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- the CLI

def prepare(example: str, out: Path) -> Path:
    """The example's warm-started tiny model as an HF folder (made once)."""
    folder = out / f"initial_{Path(example).stem}"
    if not (folder / "config.json").exists():
        subprocess.run([sys_python(), "-m", "dapo_megatron.cli", "prepare-tiny", str(REPO / example), "--out",
                        str(folder), f"trainer.run_dir={out / 'prepare'}"], cwd=REPO, env=env(), check=True)
    return folder


def sys_python() -> str:
    import sys

    return sys.executable


def run_short(out: Path, seed: int = 0) -> dict:
    """The short form: the trainer job (2 ranks, a random tiny model) with rank 0 SIGSTOPped and a reward worker
    SIGKILLed at random moments, its output's reader gone at the first fault; and its fault-free baseline, run at
    the same time (the faulty run waits out its detections meanwhile)."""
    out.mkdir(parents=True, exist_ok=True)
    steps, heldout = 14, 16
    overrides = job_overrides(JOBS["trainer"], steps, heldout, None, save_every=2)
    import threading

    baseline: dict[str, RunResult] = {}
    thread = threading.Thread(target=lambda: baseline.setdefault("trainer", run_job(
        "trainer", out / "baseline", overrides, [], steps=steps, seed=seed)))
    thread.start()
    faulty = run_job("trainer", out / "faulty", overrides, ["rank-stop", "reward-kill"], steps=steps, seed=seed,
                     dead_pipe=True, stop_rank=0, budget_s=600)
    thread.join()
    compare(faulty, baseline["trainer"])
    return {"runs": [asdict(faulty)], "baselines": {k: asdict(v) for k, v in baseline.items()},
            "rows": report([faulty], baseline, heldout), "heldout": heldout}


def run_long(out: Path, kinds: list[str], runs: int, faults: int, steps: int, heldout: int, seed: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    jobs = sorted({KINDS[k][0] for k in kinds})
    baselines, results = {}, []
    for name in jobs:
        initial = prepare(JOBS[name].prepare, out)
        overrides = job_overrides(JOBS[name], steps, heldout, initial, save_every=3)
        baselines[name] = run_job(name, out / f"{name}_baseline", overrides, [], steps=steps, seed=seed)
        for kind in [k for k in kinds if KINDS[k][0] == name]:
            for index in range(runs):
                results.append(run_job(name, out / f"{kind}_{index}", overrides, [kind] * faults, steps=steps,
                                       seed=seed + 1000 * index + zlib.crc32(kind.encode()) % 997))
                compare(results[-1], baselines[name])
        print(markdown(report(results, baselines, heldout), heldout), flush=True)
    return {"runs": [asdict(r) for r in results], "baselines": {k: asdict(v) for k, v in baselines.items()},
            "rows": report(results, baselines, heldout), "heldout": heldout}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="the test command's form")
    parser.add_argument("--kinds", default="all")
    parser.add_argument("--runs", type=int, default=2, help="runs per kind")
    parser.add_argument("--faults", type=int, default=2, help="faults per run")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--heldout", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "chaos")
    args = parser.parse_args(argv)
    if args.short:
        summary = run_short(args.out, args.seed)
    else:
        kinds = list(KINDS) if args.kinds == "all" else args.kinds.split(",")
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            parser.error(f"--kinds: unknown {unknown}; known: {list(KINDS)}")
        summary = run_long(args.out, kinds, args.runs, args.faults, args.steps, args.heldout, args.seed)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    table = markdown(summary["rows"], summary["heldout"])
    (args.out / "chaos.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
