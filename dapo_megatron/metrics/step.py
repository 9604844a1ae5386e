"""What one DAPO step reports: the scalars, from the step's rollouts, log-probs and updates, and its console line.

Names follow verl's so curves can be compared across systems (``actor/pg_loss``, ``critic/score/mean``,
``response_length/clip_ratio``, ``train/num_gen_batches`` ...). Where they go: :mod:`.metrics`.

Multi-turn responses (``rollout.tools``): the tool-output tokens (loss mask 0) are left out of the entropy, the
generation probability, the engine–policy log-prob gap and ``response_length/*`` (as verl measures them over its
response mask); ``response_length/clip_ratio`` still counts responses that reached the budget, tool output
included, since the budget counts it. :func:`tool_metrics` adds the tools' numbers.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from dapo_megatron.algorithm import FilterStats
from dapo_megatron.algorithm.staleness import staleness_metrics
from dapo_megatron.collectors.group import RolloutGroup

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


def rollout_metrics(batch: list[RolloutGroup], generated: list[RolloutGroup], stats: FilterStats, rounds: int,
                    hit_cap: bool, max_response_length: int) -> dict[str, float]:
    """The collection's numbers: filter statistics over everything generated, scores and lengths of the batch.
    A step that generated nothing (its batch came from earlier steps' groups) has no ``rollout/acc/mean``."""
    all_accs = [acc for g in generated for acc in g.accs]
    metrics = {
        "train/num_gen_batches": rounds,
        "train/hit_gen_round_cap": float(hit_cap),
        "train/num_groups": len(batch),
        "train/filter/kept_fraction": stats.kept_fraction,
        "train/filter/all_correct_fraction": stats.all_correct_fraction,
        "train/filter/all_wrong_fraction": stats.all_wrong_fraction,
        "rollout/num_samples": len(all_accs),
    }
    if all_accs:
        metrics["rollout/acc/mean"] = sum(all_accs) / len(all_accs)  # over everything generated this step
    metrics.update(reward_metrics(generated))
    metrics.update(tool_metrics(generated))
    if not batch:
        return metrics
    scores = [s for g in batch for s in g.scores]
    full_lengths = [len(resp) for g in batch for resp in g.responses]
    lengths = [len(r) if g.loss_masks is None else int(sum(m)) for g in batch for r, m in
               zip(g.responses, g.loss_masks or g.responses)]
    prompt_lengths = [len(g.prompt_ids) for g in batch]
    accs = [acc for g in batch for acc in g.accs]
    token_logprobs = torch.cat([_sampled(g, i, torch.as_tensor(lps, dtype=torch.float32).reshape(-1))
                                for g in batch for i, lps in enumerate(g.engine_logprobs)])
    metrics.update({
        "critic/score/mean": sum(scores) / len(scores),
        "critic/score/max": max(scores),
        "critic/score/min": min(scores),
        "critic/acc/mean": sum(accs) / len(accs),
        "critic/overlong_penalty/mean": sum(p for g in batch for p in g.overlong_penalties) / len(scores),
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": max(lengths),
        "response_length/min": min(lengths),
        "response_length/clip_ratio": sum(length >= max_response_length for length in full_lengths) / len(lengths),
        "prompt_length/mean": sum(prompt_lengths) / len(prompt_lengths),
        "rollout/gen_prob/mean": float(token_logprobs.exp().mean()) if token_logprobs.numel() else 0.0,
    })
    return metrics


def _sampled(group: RolloutGroup, index: int, values: torch.Tensor) -> torch.Tensor:
    """``values`` (per token of response ``index``) at the tokens the engine sampled."""
    mask = group.sampled_mask(index)
    return values if mask is None else values[mask]


def tool_metrics(generated: list[RolloutGroup]) -> dict[str, float]:
    """Over the multi-turn responses generated this step: generation turns (verl's ``num_turns/*``), tool calls,
    failed and timed-out calls per response, tool-output tokens, the share of responses that called a tool and the
    accuracy of those that did and did not (``tools/acc/with_tool``, ``tools/acc/without_tool``). Nothing without
    tools."""
    pairs = [(use, acc) for g in generated if g.tool_use is not None for use, acc in zip(g.tool_use, g.accs)]
    if not pairs:
        return {}
    uses = [use for use, _ in pairs]
    count = len(uses)
    turns = [use.turns for use in uses]
    metrics = {
        "num_turns/mean": sum(turns) / count,
        "num_turns/max": float(max(turns)),
        "num_turns/min": float(min(turns)),
        "tools/calls_per_response": sum(use.calls for use in uses) / count,
        "tools/failed_per_response": sum(use.failed for use in uses) / count,
        "tools/timeouts_per_response": sum(use.timeouts for use in uses) / count,
        "tools/output_tokens/mean": sum(use.output_tokens for use in uses) / count,
        "tools/used_fraction": sum(use.calls > 0 for use in uses) / count,
    }
    for name, used in (("with_tool", True), ("without_tool", False)):
        accs = [acc for use, acc in pairs if (use.calls > 0) == used]
        if accs:
            metrics[f"tools/acc/{name}"] = sum(accs) / len(accs)
    return metrics


def reward_metrics(generated: list[RolloutGroup]) -> dict[str, float]:
    """Over everything generated this step: failed rewards (``reward/errors``, ``reward/timeouts``), the reward's
    numeric extras (``reward/extra/<key>``, mean), the soft format bonus (``reward/format/weight``,
    ``reward/format/match_rate``), the fraction of responses that reflect (``response/reflection_rate``) and, when
    the data is a mixture, each source's groups and accuracy (``rollout/source/<name>/{groups,acc}``)."""
    metrics = {"reward/errors": float(sum(g.reward_errors for g in generated)),
               "reward/timeouts": float(sum(g.reward_timeouts for g in generated))}
    extras: dict[str, list[float]] = {}
    for group in generated:
        for key, values in (group.reward_extras or {}).items():
            extras.setdefault(key, []).extend(values)
    metrics.update({f"reward/extra/{key}": sum(values) / len(values) for key, values in sorted(extras.items())})
    formatted = [g for g in generated if g.format_weight is not None]
    if formatted:
        matches = [m for g in formatted for m in g.format_matches]
        metrics["reward/format/weight"] = formatted[-1].format_weight
        metrics["reward/format/match_rate"] = sum(matches) / len(matches)
    reflections = [r for g in generated for r in (g.reflections or [])]
    if reflections:
        metrics["response/reflection_rate"] = sum(reflections) / len(reflections)
    by_source: dict[str, list[RolloutGroup]] = {}
    for group in generated:
        if group.source_name is not None:
            by_source.setdefault(group.source_name, []).append(group)
    for name, groups in sorted(by_source.items()):
        accs = [acc for g in groups for acc in g.accs]
        metrics[f"rollout/source/{name}/groups"] = float(len(groups))
        metrics[f"rollout/source/{name}/acc"] = sum(accs) / len(accs)
    return metrics


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
    # Engine vs policy log-probs of the same tokens, over responses every token of which the policy's current
    # weights sampled (stale ones differ by the updates since, not by the engine's numerics).
    fresh = [g.weight_version == policy_version for g in groups for _ in g.responses]
    flat_engine = [lps for g in groups for lps in g.engine_logprobs]
    responses = [(g, i) for g in groups for i in range(len(g.responses))]
    gaps = [_sampled(*responses[i], (torch.as_tensor(flat_engine[i], dtype=torch.float32) - old.logprobs[i]).abs())
            for i, is_fresh in enumerate(fresh) if is_fresh]
    gap = torch.cat(gaps) if gaps else torch.empty(0)
    entropy = torch.cat([_sampled(*response, values) for response, values in zip(responses, old.entropy)])
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
        **({"rollout/logprob_diff/mean_abs": float(gap.mean()), "rollout/logprob_diff/max_abs": float(gap.max())}
           if gap.numel() else {}),
        "perf/num_tokens": float(sum(s.length for s in samples)),
        **correction,
        # a mixture-of-experts policy's routing (policy/moe_routing.py): actor/moe_aux_loss, actor/moe_load_imbalance
        **{f"actor/{key}": mean(key) for key in (applied[0] if applied else {}) if key.startswith("moe_")},
    }


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
