"""dapo-megatron vs TRL's GRPOTrainer on the same DAPO work, side by side in one run (CPU).

    python bench/bench_vs_trl.py                    # 8 prompts x 8 samples per step
    python bench/bench_vs_trl.py --batch-scale 4    # 32 prompts x 8 samples per step
    python bench/bench_vs_trl.py --repeats 2 --threads 2

What both systems do (check the comparison is fair here):

* model: one random Qwen2 folder built once by dapo-megatron's tiny-model code (examples/tiny_cpu.yaml's shape
  with 4 layers and 2 KV heads: hidden 128, 4 heads / 2 KV, FFN 256, untied embeddings, ~0.6M parameters, the
  tiny task's tokenizer), loaded by both; fp32; no warm start.
* prompts: the synthetic task's training prompts, in the order dapo-megatron's sampler draws them (TRL gets them
  pre-ordered with ``shuffle_dataset=False``), both rendered with the tokenizer's chat template (the table prints
  the mean prompt length each system saw).
* per step: ``P`` prompts x 8 samples (P = 8, or 32 with ``--batch-scale 4``), at most 32 new tokens, temperature 1,
  top-p 1, no top-k; reward = dapo-megatron's rule, imported by both; group-normalized advantages; no dynamic
  sampling, no overlong filtering or penalty (TRL's ``mask_truncated_completions`` is off too).
* loss: DAPO token-mean, clip ε 0.2 / 0.28, no KL (β = 0); TRL ``loss_type="dapo"``, ``num_iterations=1``.
  (dapo-megatron also applies its dual clip c = 10; it costs nothing measurable.)
* one optimizer update per step (dapo-megatron: mini-batch = batch; TRL: per-device batch = P x 8 completions,
  no gradient accumulation), Adam lr 1e-4 constant, no weight decay, grad-norm clip 1.0.
* generation: dapo-megatron's embedded engine; TRL: HF ``generate`` (its default path, no vLLM).
* TRL's gradient checkpointing is turned off (its default is on; dapo-megatron does not recompute), which can only
  make TRL faster.
* threads: both processes call ``torch.set_num_threads(--threads)`` (default 1).

What is measured: each system runs in its own interpreter (TRL in ``bench/.venv-trl``, made on first use with pinned
``torch`` (the project's version), ``trl==1.16.0`` and ``transformers==5.24.0``; nothing is installed into the
project's environment). Per step: wall and CPU time of the whole step and of the phases ``gen`` (generation +
reward + advantages), ``old_logprob``, ``update`` (forward + backward + optimizer) and ``handoff`` (weights to the
engine). At one update per step neither system runs an old-log-prob pass (both take π_old from the update's own
forward, detached: 0); TRL has no handoff (0). The first ``--warmup`` steps are
dropped; the table shows medians over the rest (pooled over ``--repeats``, which alternate the systems), the peak
RSS of each process and the ratio dapo-megatron / TRL of the time per generated token. With one thread, CPU time
is the steadier number on a shared machine (it does not count time spent waiting for a core).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
TRL_VENV = BENCH_DIR / ".venv-trl"
TRL_PINS = (f"torch=={torch.__version__.split('+')[0]}", "trl==1.16.0", "transformers==5.24.0")
PHASES = ("gen", "old_logprob", "update", "handoff")


def trl_python() -> Path:
    """The TRL venv's interpreter; the venv is (re)made when missing or when its pins differ from ``TRL_PINS``."""
    python = TRL_VENV / "bin" / "python"
    marker = TRL_VENV / "bench-pins.txt"
    if python.exists() and marker.exists() and marker.read_text().split() == list(TRL_PINS):
        return python
    print(f"making {TRL_VENV} with {' '.join(TRL_PINS)} (once)", flush=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(TRL_VENV)
    # torch first and alone: resolving it together with trl lets pip pick another build of it.
    for packages in ([TRL_PINS[0]], list(TRL_PINS)):
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"pip install {' '.join(packages)} into {TRL_VENV} failed:\n{done.stderr[-3000:]}")
    marker.write_text("\n".join(TRL_PINS) + "\n")
    return python


def bench_config(seed: int):
    """examples/tiny_cpu.yaml with the benchmark's model shape (4 layers, 2 KV heads) and no warm start."""
    from dapo_megatron.config import load_config

    return load_config(REPO_ROOT / "examples" / "tiny_cpu.yaml", [
        "model.tiny.num_layers=4", "model.tiny.num_key_value_heads=2", "warm_start.enabled=false",
        f"trainer.seed={seed}"])


def prepare_workload(args: argparse.Namespace, work_dir: Path) -> dict:
    """Build the model folder and the prompt list both systems use; returns the workload (also written as JSON)."""
    from safetensors import safe_open

    from dapo_megatron.data.prompts import build_prompt_records
    from dapo_megatron.data.sampler import PromptSampler
    from dapo_megatron.data.schema import validate_row
    from dapo_megatron.tiny_model import prepare_tiny_model
    from dapo_megatron.run.model_source import load_tokenizer
    from dapo_megatron.data.task import synthetic_split

    prompts_per_step = 8 * args.batch_scale
    config = bench_config(args.seed)
    tiny = config.model.tiny
    model_dir = prepare_tiny_model(config, work_dir / "model")
    tokenizer = load_tokenizer(config, model_dir)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as weights:
        num_params = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    # The trainer's prompt pipeline (trainer.task.build_task), keeping the rows for their chat messages.
    rows = [validate_row(r, source="synthetic/train", row=i, integer_answers=True)
            for i, r in enumerate(synthetic_split(config).train_rows())]
    records = build_prompt_records(rows, tokenizer, max_prompt_length=config.data.max_prompt_length).records
    if len(records) != len(rows):
        raise RuntimeError("some synthetic prompts were filtered: the TRL prompt list would not line up")
    sampler = PromptSampler(records, batch_size=prompts_per_step, seed=args.seed)
    ordered = [i for _ in range(args.steps) for i in sampler.next_indices()]
    workload = {
        "model_dir": str(model_dir),
        "model": {"hidden": tiny.hidden_size, "layers": tiny.num_layers, "heads": tiny.num_attention_heads,
                  "kv_heads": tiny.num_key_value_heads, "ffn": tiny.intermediate_size, "vocab": len(tokenizer),
                  "parameters": num_params},
        "prompts": [{"messages": rows[i].messages(), "ground_truth": rows[i].ground_truth} for i in ordered],
        "prompts_per_step": prompts_per_step,
        "samples_per_prompt": 8,
        "max_new_tokens": 32,
        "steps": args.steps,
        "temperature": 1.0,
        "eps_low": 0.2,
        "eps_high": 0.28,
        "lr": 1e-4,
        "grad_clip": 1.0,
        "seed": args.seed,
        "threads": args.threads,
    }
    (work_dir / "workload.json").write_text(json.dumps(workload))
    return workload


def run_system(python: Path, runner: str, work_dir: Path, label: str, threads: int) -> dict:
    """One system in its own interpreter; returns its result JSON. Its output goes to ``<work_dir>/<label>.log``."""
    out_dir = work_dir / label
    out_dir.mkdir(parents=True, exist_ok=True)
    log = work_dir / f"{label}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with log.open("w") as sink:
        code = subprocess.run([str(python), str(BENCH_DIR / "vs_trl" / runner), str(work_dir / "workload.json"),
                               str(out_dir / "result.json")], stdout=sink, stderr=subprocess.STDOUT, env=env).returncode
    if code:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"{label} exited with {code}; last lines of {log}:\n{tail}")
    return json.loads((out_dir / "result.json").read_text())


def summarize(results: list[dict], warmup: int) -> dict:
    """Medians over the steps after the first ``warmup`` of each run, pooled over runs."""
    steps = [step for result in results for step in result["steps"][warmup:]]
    if not steps:
        raise ValueError(f"no step left after dropping {warmup} warm-up steps")
    summary = {"measured_steps": len(steps), "peak_rss_mib": max(r["peak_rss_mib"] for r in results),
               "versions": results[0]["versions"]}
    for key in ("generated_tokens", "num_samples", "prompt_tokens_mean"):
        summary[key] = statistics.median(step[key] for step in steps)
    for clock in ("wall", "cpu"):
        for phase in ("step", *PHASES):
            summary[f"{phase}_{clock}"] = statistics.median(step[f"{phase}_{clock}"] for step in steps)
        summary[f"s_per_token_{clock}"] = statistics.median(step[f"step_{clock}"] / step["generated_tokens"]
                                                            for step in steps)
    return summary


def format_table(trl: dict, dapo: dict) -> str:
    def row(label: str, key: str, spec: str = ".3f", ratio: bool = True, scale: float = 1.0) -> str:
        a, b = trl[key] * scale, dapo[key] * scale
        r = f"{b / a:8.2f}" if ratio and a else " " * 8
        return f"{label:<30}{a:>12{spec}}{b:>16{spec}}{r}"

    lines = [f"{'':<30}{'TRL ' + trl['versions']['trl']:>12}{'dapo-megatron':>16}{'ratio':>8}",
             row("generated tokens / step", "generated_tokens", ".0f", ratio=False),
             row("samples / step", "num_samples", ".0f", ratio=False),
             row("prompt tokens / sample", "prompt_tokens_mean", ".1f", ratio=False)]
    for clock in ("wall", "cpu"):
        lines.append(row(f"s / step ({clock})", f"step_{clock}"))
        lines += [row(f"  {phase}", f"{phase}_{clock}") for phase in PHASES]
        lines.append(row(f"ms / generated token ({clock})", f"s_per_token_{clock}", scale=1e3))
        lines.append(f"{f'generated tokens / s ({clock})':<30}{1 / trl[f's_per_token_{clock}']:>12.0f}"
                     f"{1 / dapo[f's_per_token_{clock}']:>16.0f}")
    lines.append(row("peak RSS (MiB)", "peak_rss_mib", ".0f"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-scale", type=int, default=1, help="prompts per step = 8 x this (1 or 4 in the issue)")
    parser.add_argument("--steps", type=int, default=10, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="leading steps of each run left out of the medians")
    parser.add_argument("--repeats", type=int, default=1, help="runs per system, alternating TRL and dapo-megatron")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for both systems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default="trl,dapo", help="comma list of trl, dapo (both for the ratio)")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the model, logs and results here")
    parser.add_argument("--json-out", type=Path, default=None, help="write the per-step results and medians here")
    args = parser.parse_args()
    if args.batch_scale < 1 or args.steps <= args.warmup or args.repeats < 1 or args.threads < 1:
        parser.error("need --batch-scale >= 1, --steps > --warmup, --repeats >= 1, --threads >= 1")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - {"trl", "dapo"})
    if unknown or not systems:
        parser.error(f"--systems: unknown {unknown}; choose from trl, dapo")

    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as tmp:
        work_dir = args.work_dir or Path(tmp)
        work_dir.mkdir(parents=True, exist_ok=True)
        workload = prepare_workload(args, work_dir)
        interpreters = {"trl": (trl_python() if "trl" in systems else None, "trl_runner.py"),
                        "dapo": (Path(sys.executable), "dapo_runner.py")}
        results: dict[str, list[dict]] = {s: [] for s in systems}
        for repeat in range(args.repeats):
            for system in systems:
                python, runner = interpreters[system]
                print(f"run {repeat + 1}/{args.repeats}: {system} ...", flush=True)
                results[system].append(run_system(python, runner, work_dir, f"{system}_{repeat}", args.threads))

    m = workload["model"]
    print(f"\nworkload: {workload['prompts_per_step']} prompts x {workload['samples_per_prompt']} samples per step, "
          f"<= {workload['max_new_tokens']} new tokens, 1 optimizer update per step, fp32; random Qwen2 "
          f"{m['parameters'] / 1e6:.2f}M parameters (hidden {m['hidden']}, {m['layers']} layers, "
          f"{m['heads']}/{m['kv_heads']} heads, FFN {m['ffn']}, vocab {m['vocab']}); threads {args.threads}; "
          f"medians of {args.steps - args.warmup} steps after {args.warmup} warm-up x {args.repeats} run(s)")
    summaries = {s: summarize(r, args.warmup) for s, r in results.items()}
    if set(summaries) == {"trl", "dapo"}:
        print(format_table(summaries["trl"], summaries["dapo"]))
        print("ratio = dapo-megatron / TRL (below 1: dapo-megatron is faster); per generated token is the headline")
    else:
        print(json.dumps(summaries, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps({"workload": {k: v for k, v in workload.items() if k != "prompts"},
                                             "args": {k: str(v) for k, v in vars(args).items()},
                                             "summary": summaries, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
