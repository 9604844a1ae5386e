"""What one DAPO step reports: the scalars, from the step's rollouts, log-probs and updates, and its console line.

Names follow verl's so curves can be compared across systems (``actor/pg_loss``, ``critic/score/mean``,
``response_length/clip_ratio``, ``train/num_gen_batches`` ...). Where they go: :mod:`.writer`.

Multi-turn responses (``rollout.tools``): the tool-output tokens (loss mask 0) are left out of the entropy, the
generation probability, the engine–policy log-prob gap and ``response_length/*`` (as verl measures them over its
response mask); ``response_length/clip_ratio`` still counts responses that reached the budget, tool output
included, since the budget counts it. The rollout's scalars are the collectors'
(:mod:`dapo_megatron.collectors.rollout_metrics`).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from dapo_megatron.algorithm.staleness import staleness_metrics
from dapo_megatron.collectors.group import RolloutGroup
from dapo_megatron.collectors.rollout_metrics import sampled_values

if TYPE_CHECKING:
    from dapo_megatron.policy.actor import PolicyLogProbs
    from dapo_megatron.policy.packing import PolicySample


class StepTimer:
    """Seconds per phase of a step: wall clock (``timing_s/<phase>``) and this process's CPU time
    (``timing_cpu_s/<phase>``, which a loaded machine distorts far less); a phase entered twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + time.process_time() - cpu_start


def staleness_of_batch(groups: list[RolloutGroup], policy_version: int) -> dict[str, float]:
    """How off-policy the batch is, counted against the policy's version: the fraction of groups with a token
    sampled by older weights (``train/stale_group_fraction``) and the per-response staleness histogram."""
    if not groups:
        return {}
    staleness = [g.response_staleness(i, policy_version) for g in groups for i in range(len(g.responses))]
    return {"train/stale_group_fraction": sum(g.weight_version < policy_version for g in groups) / len(groups),
            **staleness_metrics(staleness)}


def policy_metrics(groups: list[RolloutGroup], samples: list["PolicySample"], old: "PolicyLogProbs | None",
                   updates: list[dict], correction: dict[str, float], *, policy_version: int) -> dict[str, float]:
    """The policy side (what :class:`dapo_megatron.trainer.policy_update.StepUpdate` holds): loss, clip fractions,
    KL, entropy, gradient norm over the applied updates, staleness against ``policy_version``, the gap between the
    engine's and the policy's log-probs of the sampled tokens, and the rollout correction's diagnostics."""
    if not samples:
        return {"train/skipped_empty_batch": 1.0, **staleness_of_batch(groups, policy_version)}
    responses = [(g, i) for g in groups for i in range(len(g.responses))]
    entropy = torch.cat([sampled_values(*response, values) for response, values in zip(responses, old.entropy)])
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
        **staleness_of_batch(groups, policy_version),
        **engine_logprob_gap(groups, old.logprobs, policy_version, "rollout/logprob_diff"),
        "perf/num_tokens": float(sum(s.length for s in samples)),
        **correction,
        # a mixture-of-experts policy's routing (policy/moe_routing.py): actor/moe_aux_loss, actor/moe_load_imbalance
        **{f"actor/{key}": mean(key) for key in (applied[0] if applied else {}) if key.startswith("moe_")},
    }


def engine_logprob_gap(groups: list, logprobs: list[torch.Tensor], policy_version: int, name: str
                       ) -> dict[str, float]:
    """``name/{mean,max}_abs``: engine vs policy log-probs of the same tokens, over responses every token of which
    the policy's current weights sampled (stale ones differ by the updates since, not by the engine's numerics)."""
    fresh = [g.weight_version == policy_version for g in groups for _ in g.responses]
    flat_engine = [lps for g in groups for lps in g.engine_logprobs]
    responses = [(g, i) for g in groups for i in range(len(g.responses))]
    gaps = [sampled_values(*responses[i], (torch.as_tensor(flat_engine[i], dtype=torch.float32) - logprobs[i]).abs())
            for i, is_fresh in enumerate(fresh) if is_fresh]
    gap = torch.cat(gaps) if gaps else torch.empty(0)
    return {f"{name}/mean_abs": float(gap.mean()), f"{name}/max_abs": float(gap.max())} if gap.numel() else {}


def step_metrics(rollout: dict[str, float], policy: dict[str, float], timer: StepTimer,
                 weight_version: int) -> dict[str, float]:
    """One row of ``metrics.jsonl`` (before validation): rollout + policy numbers, timings, throughput."""
    metrics = {**rollout, **policy, "rollout/weight_version": float(weight_version),
               **{f"timing_s/{k}": v for k, v in timer.seconds.items()},
               **{f"timing_cpu_s/{k}": v for k, v in timer.cpu_seconds.items()}}
    metrics["perf/throughput"] = metrics.get("perf/num_tokens", 0.0) / max(timer.seconds["step"], 1e-9)
    return metrics


def summary_line(step: int, total: int, m: dict[str, float]) -> str:
    def fmt(key: str, spec: str = ".3f") -> str:
        value = m.get(key)
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    return (f"step {step}/{total} | score {fmt('critic/score/mean')} | acc {fmt('rollout/acc/mean')} | "
            f"kept {fmt('train/filter/kept_fraction', '.2f')} | gen rounds {m.get('train/num_gen_batches', 0)} | "
            f"pg_loss {fmt('actor/pg_loss', '.4f')} | entropy {fmt('actor/entropy')} | "
            f"clip {fmt('actor/pg_clipfrac', '.4f')} | len {fmt('response_length/mean', '.1f')} | "
            f"{fmt('timing_s/step', '.1f')} s")
