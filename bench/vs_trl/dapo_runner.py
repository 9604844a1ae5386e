"""One ``dapo-megatron train`` run of the shared workload, in the project's venv (see ``bench/bench_vs_trl.py``).

    python bench/vs_trl/dapo_runner.py WORKLOAD.json RESULT.json

Runs the real CLI (``dapo-megatron train examples/tiny_cpu.yaml`` + the overrides below) in this process and writes
per-step times (wall and CPU), generated tokens and the peak RSS as JSON. The phases are the trainer's own
(``timing_s/{gen,old_logprob,update,handoff,step}`` and their CPU-time twins ``timing_cpu_s/*``), read back from the
run's ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from result import run_from_argv, write_result

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))


def overrides(workload: dict, run_dir: Path) -> list[str]:
    """The workload as dotted overrides of examples/tiny_cpu.yaml."""
    return [
        "model.source=hf", f"model.hf_path={workload['model_dir']}",
        f"rollout.n_samples={workload['samples_per_prompt']}",
        f"rollout.max_response_length={workload['max_new_tokens']}",
        f"rollout.temperature={workload['temperature']}",
        f"trainer.train_batch_size={workload['prompts_per_step']}",
        f"trainer.mini_batch_size={workload['prompts_per_step']}",  # one optimizer update per step
        f"trainer.total_steps={workload['steps']}", f"trainer.seed={workload['seed']}",
        f"trainer.run_dir={run_dir}", "trainer.save_every=0", "trainer.tensorboard=false",
        f"algorithm.eps_low={workload['eps_low']}", f"algorithm.eps_high={workload['eps_high']}",
        "algorithm.dynamic_sampling=false", "algorithm.overlong_filtering=false", "algorithm.overlong_penalty=false",
        f"optim.lr={workload['lr']}", f"optim.grad_clip={workload['grad_clip']}", "optim.warmup_steps=0",
        "optim.weight_decay=0.0", "warm_start.enabled=false",
        "eval.every=0", "eval.max_problems=8",  # validation runs before and after the steps only, outside their time
    ]


def main(workload_path: str, result_path: str) -> None:
    workload = json.loads(Path(workload_path).read_text())
    import torch

    torch.set_num_threads(workload["threads"])
    from dapo_megatron import cli
    from dapo_megatron.metrics.writer import read_metrics

    run_dir = Path(result_path).parent / "dapo_run"
    code = cli.main(["train", str(REPO_ROOT / "examples" / "tiny_cpu.yaml"), *overrides(workload, run_dir)])
    if code:
        raise SystemExit(f"dapo-megatron train exited with {code}")
    logged = [m for m in read_metrics(run_dir) if m["step"] >= 1]
    steps = []
    for metrics in logged:
        num_samples = int(metrics["rollout/num_samples"])
        step = {"generated_tokens": round(metrics["response_length/mean"] * num_samples),
                "num_samples": num_samples, "prompt_tokens_mean": metrics["prompt_length/mean"]}
        for phase in ("step", "gen", "old_logprob", "update", "handoff"):
            step[f"{phase}_wall"] = metrics.get(f"timing_s/{phase}", 0.0)
            step[f"{phase}_cpu"] = metrics.get(f"timing_cpu_s/{phase}", 0.0)
        steps.append(step)
    import megatron.core
    import transformers

    write_result(result_path, "dapo-megatron",
                 {"megatron-core": megatron.core.__version__, "transformers": transformers.__version__}, steps)


if __name__ == "__main__":
    run_from_argv(main)
