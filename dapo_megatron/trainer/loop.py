"""The DAPO training loop, top to bottom.

Every rank runs :meth:`DAPOTrainer.run`. Global rank 0 also drives the rollout engine (the embedded engine lives in
its process; SGLang servers are called from it); the other ranks wait for its batch in a broadcast. One step:

1. rank 0 collects a batch: prompts → G responses → reward + overlong shaping → dynamic-sampling filter → buffer,
   until the batch is full or the generation-round cap is hit (:mod:`.rollout_collector`);
2. the batch is broadcast; every rank builds the same training samples (advantages, overlong-filtered masks);
3. old log-probs are recomputed by the policy (forward only);
4. ``train_batch_size / mini_batch_size`` optimizer updates on shuffled mini-batches, token-mean loss
   (:meth:`dapo_megatron.policy.actor.Actor.train_minibatch`);
5. the new weights go to the engine (Megatron shards → HF tensors → ``engine.update_weights``);
6. metrics are logged (TensorBoard + metrics.jsonl), a checkpoint is written and validation runs on schedule.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from dapo_megatron.algorithm import group_advantages
from dapo_megatron.config import DAPOConfig, save_config
from dapo_megatron.platform import init_distributed, seed_everything
from dapo_megatron.policy.packing import PolicySample
from dapo_megatron.trainer import checkpoint as ckpt
from dapo_megatron.trainer.evaluate import evaluate
from dapo_megatron.trainer.metrics import MetricsWriter
from dapo_megatron.trainer.rollout_collector import RolloutCollector, RolloutGroup

logger = logging.getLogger(__name__)


class Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def training_samples(groups: list[RolloutGroup], config: DAPOConfig) -> list[PolicySample]:
    """Groups → one PolicySample per response: group-normalized advantage; a zero loss mask for a truncated
    response when overlong filtering is on."""
    if not groups:
        return []
    scores = torch.tensor([g.scores for g in groups], dtype=torch.float32)
    advantages = group_advantages(scores, eps=config.algorithm.advantage_eps)
    samples = []
    for group, group_adv in zip(groups, advantages):
        for response, truncated, adv in zip(group.responses, group.truncated, group_adv.tolist()):
            mask = torch.zeros(len(response)) if (truncated and config.algorithm.overlong_filtering) else None
            samples.append(PolicySample(prompt_ids=group.prompt_ids, response_ids=response, advantage=adv,
                                        loss_mask=mask))
    return samples


def mini_batches(samples: list[PolicySample], config: DAPOConfig, step: int) -> list[list[PolicySample]]:
    """Shuffle (seeded by run seed and step: the same on every rank, and on a resumed run) and split."""
    per_mini_batch = config.trainer.mini_batch_size * config.rollout.n_samples
    generator = torch.Generator().manual_seed(config.trainer.seed * 7_919 + step)
    order = torch.randperm(len(samples), generator=generator).tolist()
    shuffled = [samples[i] for i in order]
    return [shuffled[i:i + per_mini_batch] for i in range(0, len(shuffled), per_mini_batch)]


def _broadcast_object(obj, src: int = 0):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


class DAPOTrainer:
    def __init__(self, config: DAPOConfig, *, resume: bool = False):
        self.config = config
        self.resume = resume
        p = config.parallel
        self.layout = init_distributed(p.tensor, p.pipeline, p.data, timeout_s=p.collective_timeout_s)
        self.rank = self.layout.rank
        seed_everything(config.trainer.seed)
        self.run_dir = Path(config.trainer.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.first_eval: dict[str, float] | None = None  # validation before any RL step (kept across resumes)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(config, self.run_dir / "config.yaml")
        self._build()

    # ------------------------------------------------------------------------------------------------ setup

    def _build(self) -> None:
        from dapo_megatron.policy.actor import build_actor
        from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec
        from dapo_megatron.trainer.model_source import load_tokenizer, prepare_initial_model

        c = self.config
        initial = prepare_initial_model(c, self.run_dir) if self.rank == 0 else None
        initial = _broadcast_object(initial)
        self.initial_model = initial
        self.tokenizer = load_tokenizer(initial.tokenizer_dir)
        self.spec = load_model_spec(initial.hf_dir)
        self.actor = build_actor(self.spec, model=c.model, parallel=c.parallel, optim=c.optim, algorithm=c.algorithm,
                                 micro_batch_tokens=c.trainer.micro_batch_tokens, temperature=c.rollout.temperature)
        load_hf_weights(self.actor.model, self.spec, initial.hf_dir)
        self.actor.optimizer.reload_model_params()

        self.engine = None
        self.collector = None
        self.writer = MetricsWriter(self.run_dir, tensorboard=c.trainer.tensorboard, enabled=self.rank == 0)
        if self.rank == 0:
            from dapo_megatron.data.sampler import PromptSampler
            from dapo_megatron.rollout.factory import build_rollout_engine
            from dapo_megatron.trainer.task import build_task

            self.task = build_task(c, self.tokenizer)
            sampler = PromptSampler(self.task.train, batch_size=c.trainer.train_batch_size, seed=c.trainer.seed)
            self.engine = build_rollout_engine(c, initial.hf_dir, self.run_dir)
            self.collector = RolloutCollector(self.engine, sampler, self.tokenizer, c)

    # ------------------------------------------------------------------------------------------------ pieces

    def hand_off_weights(self, version: int) -> None:
        """Megatron shards → full HF tensors (bucketed, gathered to rank 0) → the rollout engine."""
        from dapo_megatron.handoff import gather_hf_buckets_to_rank0

        buckets = gather_hf_buckets_to_rank0(self.actor.model, self.spec,
                                             bucket_bytes=self.config.rollout.handoff_bucket_mb * 2**20)
        if self.rank == 0:
            self.engine.update_weights((named for bucket in buckets for named in bucket), version)
        else:
            for _ in buckets:
                pass

    def validate(self) -> dict[str, float]:
        metrics = {}
        if self.rank == 0 and self.task.eval:
            metrics = evaluate(self.engine, self.task.eval, self.tokenizer, self.config)
        return _broadcast_object(metrics)

    def train_on(self, groups: list[RolloutGroup], step: int, timer: Timer) -> dict[str, float]:
        samples = training_samples(groups, self.config)
        if not samples:
            return {"train/skipped_empty_batch": 1.0}
        with timer.phase("old_logprob"):
            old = self.actor.compute_logprobs(samples)
        samples = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(samples, old.logprobs)]
        # Engine vs policy log-probs of the same tokens, over responses sampled by the weights the policy has now
        # (surplus groups kept from an earlier step were sampled by older weights and differ by design).
        current = max(g.weight_version for g in groups)
        sample_versions = [g.weight_version for g in groups for _ in g.responses]
        fresh = [i for i, version in enumerate(sample_versions) if version == current]
        flat_engine = [lps for g in groups for lps in g.engine_logprobs]
        gap = torch.cat([(torch.tensor(flat_engine[i], dtype=torch.float32) - old.logprobs[i]).abs() for i in fresh])
        entropy = torch.cat(old.entropy)

        updates = []
        with timer.phase("update"):
            batches = mini_batches(samples, self.config, step)
            for mini_batch in tqdm(batches, desc=f"step {step + 1} updates", leave=False, unit="mini-batch",
                                   disable=self.rank != 0 or not sys.stderr.isatty()):
                updates.append(self.actor.train_minibatch(mini_batch))
        applied = [u for u in updates if not u["skipped"]]

        def mean(key: str) -> float:
            values = [u[key] for u in applied]
            return sum(values) / len(values) if values else float("nan")

        return {
            "actor/pg_loss": mean("pg_loss"),
            "actor/pg_clipfrac": mean("clipfrac_high") + mean("clipfrac_low"),
            "actor/pg_clipfrac_high": mean("clipfrac_high"),
            "actor/pg_clipfrac_low": mean("clipfrac_low"),
            "actor/pg_clipfrac_lower": mean("clipfrac_dual"),  # verl's name for the dual-clip fraction
            "actor/ppo_kl": mean("approx_kl"),
            "actor/entropy": float(entropy.mean()),
            "actor/grad_norm": mean("grad_norm"),
            "actor/lr": updates[-1]["lr"],
            "actor/num_updates": float(len(applied)),
            "actor/skipped_updates": float(len(updates) - len(applied)),
            "actor/packing_efficiency": mean("packing_efficiency"),
            "train/stale_group_fraction": sum(g.weight_version != current for g in groups) / len(groups),
            "rollout/logprob_diff/mean_abs": float(gap.mean()),
            "rollout/logprob_diff/max_abs": float(gap.max()),
            "perf/num_tokens": float(sum(s.length for s in samples)),
        }

    # ------------------------------------------------------------------------------------------------ state

    def _trainer_state(self, step: int) -> dict:
        return {"step": step, "scheduler": self.actor.scheduler.state_dict(),
                "collector": self.collector.state_dict() if self.collector else None,
                "first_eval": self.first_eval}

    def save(self, step: int) -> None:
        ckpt.save_checkpoint(self.ckpt_dir, step, model_chunks=[self.actor.model], optimizer=self.actor.optimizer,
                             trainer_state=self._trainer_state(step), hf_files_dir=self._hf_files_dir(),
                             keep=self.config.trainer.keep_checkpoints)

    def _hf_files_dir(self) -> Path | None:
        """config.json + tokenizer of the initial model, copied into checkpoints for HF export."""
        if self.rank != 0:
            return None
        out = self.run_dir / "hf_files"
        if not out.exists():
            tmp = self.run_dir / "hf_files.tmp"
            tmp.mkdir(parents=True, exist_ok=True)
            src = self.initial_model.hf_dir
            for path in list(Path(src).glob("*.json")) + list(Path(src).glob("*.txt")) + list(Path(src).glob("*.model")):
                if path.name != "model.safetensors.index.json":
                    (tmp / path.name).write_bytes(path.read_bytes())
            tmp.rename(out)
        return out

    def restore(self) -> int:
        path = ckpt.latest_checkpoint(self.ckpt_dir)
        if path is None:
            logger.info("no checkpoint under %s: starting from step 0", self.ckpt_dir)
            return 0
        state = ckpt.load_checkpoint(path, model_chunks=[self.actor.model], optimizer=self.actor.optimizer)
        self.actor.scheduler.load_state_dict(state["scheduler"])
        if self.collector is not None:
            self.collector.load_state_dict(state["collector"])
        self.first_eval = state.get("first_eval")
        self.writer.truncate_after(state["step"])
        logger.info("resumed from %s (step %d)", path, state["step"])
        return state["step"]

    # ------------------------------------------------------------------------------------------------ the loop

    def run(self) -> dict:
        c = self.config
        step = self.restore() if self.resume else 0
        self.hand_off_weights(version=step)
        if step == 0:
            self.first_eval = self.validate()
            self.writer.log(0, self.first_eval)
        last_eval = self.first_eval
        while step < c.trainer.total_steps:
            timer = Timer()
            with timer.phase("step"):
                with timer.phase("gen"):
                    groups, rollout_metrics = (self.collector.collect(step) if self.rank == 0 else (None, None))
                    groups, rollout_metrics = _broadcast_object((groups, rollout_metrics))
                train_metrics = self.train_on(groups, step, timer)
                with timer.phase("handoff"):
                    self.hand_off_weights(version=step + 1)
            step += 1
            metrics = {**rollout_metrics, **train_metrics,
                       "rollout/weight_version": float(self.engine.weight_version) if self.engine else float(step),
                       **{f"timing_s/{k}": v for k, v in timer.seconds.items()}}
            metrics["perf/throughput"] = metrics.get("perf/num_tokens", 0.0) / max(timer.seconds["step"], 1e-9)
            if c.eval.every and step % c.eval.every == 0 and step < c.trainer.total_steps:
                with timer.phase("eval"):
                    last_eval = self.validate()
                metrics.update(last_eval)
            if step == c.trainer.total_steps:
                last_eval = self.validate()
                metrics.update(last_eval)
            self.writer.log(step, metrics)
            if self.rank == 0:
                print(_summary_line(step, c.trainer.total_steps, metrics), flush=True)
            if (c.trainer.save_every and step % c.trainer.save_every == 0) or step == c.trainer.total_steps:
                self.save(step)
        self.writer.close()
        return {"first_eval": self.first_eval or {}, "last_eval": last_eval or {}, "steps": step}

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def _summary_line(step: int, total: int, m: dict[str, float]) -> str:
    def fmt(key: str, spec: str = ".3f") -> str:
        value = m.get(key)
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    return (f"step {step}/{total} | score {fmt('critic/score/mean')} | acc {fmt('rollout/acc/mean')} | "
            f"kept {fmt('train/filter/kept_fraction', '.2f')} | gen rounds {m.get('train/num_gen_batches', 0)} | "
            f"pg_loss {fmt('actor/pg_loss', '.4f')} | entropy {fmt('actor/entropy')} | "
            f"clip {fmt('actor/pg_clipfrac', '.4f')} | len {fmt('response_length/mean', '.1f')} | "
            f"{fmt('timing_s/step', '.1f')} s")
