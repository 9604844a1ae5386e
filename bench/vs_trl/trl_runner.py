"""One TRL ``GRPOTrainer`` run of the shared workload; runs in TRL's own venv (see ``bench/bench_vs_trl.py``).

    bench/.venv-trl/bin/python bench/vs_trl/trl_runner.py WORKLOAD.json RESULT.json

Reads the workload the orchestrator wrote (model folder, prompts in step order, batch shape, optimizer settings),
trains with TRL's DAPO loss and writes per-step times (wall and CPU), generated tokens and the peak RSS as JSON.
The reward is dapo-megatron's own rule (``dapo_megatron.reward.rule``, pure Python), imported from the
repository so both systems score the same way.

Phases, measured by subclassing the trainer (nothing in TRL is patched):
``gen`` = ``_generate_and_score_completions`` (HF ``generate``, decoding, reward, advantages);
``old_logprob`` = 0: with one update per generation batch TRL does not run that forward (it uses the detached
training log-probs); ``update`` = the rest of the step (forward, backward, clip, AdamW); ``handoff`` = 0 (the
policy generates itself). A step is ``on_step_begin`` → ``on_step_end`` (logging is outside, as in dapo-megatron).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from result import run_from_argv, write_result

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))


class DualClock:
    """Wall (perf_counter) and process CPU time; with one torch thread CPU time is immune to other load."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def elapsed(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def main(workload_path: str, result_path: str) -> None:
    workload = json.loads(Path(workload_path).read_text())
    import torch

    torch.set_num_threads(workload["threads"])
    torch.manual_seed(workload["seed"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dapo_megatron.reward.rule import math_reward

    steps: list[dict] = []
    current: dict = {}

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            clock = DualClock()
            out = super()._generate_and_score_completions(inputs)
            current["gen_wall"], current["gen_cpu"] = clock.elapsed()
            return out

        def _generate(self, prompts):
            out = super()._generate(prompts)
            prompt_ids, completion_ids = out[0], out[1]
            current["generated_tokens"] = sum(len(ids) for ids in completion_ids)
            current["num_samples"] = len(completion_ids)
            current["prompt_tokens_mean"] = sum(len(ids) for ids in prompt_ids) / len(prompt_ids)
            return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.clear()
            current["clock"] = DualClock()

        def on_step_end(self, args, state, control, **kwargs):
            wall, cpu = current.pop("clock").elapsed()
            steps.append({
                "step_wall": wall, "step_cpu": cpu,
                "gen_wall": current["gen_wall"], "gen_cpu": current["gen_cpu"],
                "old_logprob_wall": 0.0, "old_logprob_cpu": 0.0,
                "update_wall": wall - current["gen_wall"], "update_cpu": cpu - current["gen_cpu"],
                "handoff_wall": 0.0, "handoff_cpu": 0.0,
                "generated_tokens": current["generated_tokens"], "num_samples": current["num_samples"],
                "prompt_tokens_mean": current["prompt_tokens_mean"],
            })

    def reward(completions, ground_truth, **kwargs):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [math_reward(text, truth).score for text, truth in zip(texts, ground_truth)]

    rows = [{"prompt": p["messages"], "ground_truth": p["ground_truth"]} for p in workload["prompts"]]
    batch_rows = workload["prompts_per_step"] * workload["samples_per_prompt"]
    config = GRPOConfig(
        output_dir=str(Path(result_path).parent / "trl_output"),
        per_device_train_batch_size=batch_rows,
        gradient_accumulation_steps=1,
        num_generations=workload["samples_per_prompt"],
        max_completion_length=workload["max_new_tokens"],
        max_steps=workload["steps"],
        num_iterations=1,
        loss_type="dapo",
        epsilon=workload["eps_low"],
        epsilon_high=workload["eps_high"],
        beta=0.0,
        temperature=workload["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=workload["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=workload["grad_clip"],
        optim="adamw_torch",
        gradient_checkpointing=False,  # TRL's default is True; dapo-megatron does not recompute activations
        bf16=False,
        fp16=False,
        use_cpu=True,
        shuffle_dataset=False,  # the prompts are already in dapo-megatron's sampler order
        seed=workload["seed"],
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(workload["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(workload["model_dir"], dtype=torch.float32)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                               processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    write_result(result_path, "trl", {"trl": __import__("trl").__version__,
                                      "transformers": __import__("transformers").__version__}, steps)


if __name__ == "__main__":
    run_from_argv(main)
