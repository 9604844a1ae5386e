"""What a collector reports of the rollouts behind a step (verl's names: ``critic/score/mean``,
``response_length/clip_ratio``, ``train/num_gen_batches`` ...): rewards, lengths, the filter's counts, the tools'
numbers. Multi-turn responses count their sampled tokens only (:func:`sampled_values`);
``response_length/clip_ratio`` counts responses that reached the budget, tool output included. The step's other
scalars: :mod:`dapo_megatron.metrics.step`.
"""

from __future__ import annotations


import torch

from dapo_megatron.algorithm import FilterStats
from dapo_megatron.collectors.group import RolloutGroup
from dapo_megatron.rollout.engine import ToolUse
from dapo_megatron.tools.result import tool_counts


def rollout_metrics(batch: list[RolloutGroup], generated: list[RolloutGroup], stats: FilterStats, rounds: int,
                    hit_cap: bool, max_response_length: int, tool_names: list[str] = ()) -> dict[str, float]:
    """The collection's numbers: filter statistics over everything generated, scores and lengths of the batch.
    A step that generated nothing (its batch came from earlier steps' groups) has no ``rollout/acc/mean``.
    ``tool_names``: the run's tools (none: single-turn rollouts, no tool numbers)."""
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
    if tool_names:
        metrics.update(tool_call_counts(generated, tool_names))
    if not batch:
        return metrics
    scores = [s for g in batch for s in g.scores]
    full_lengths = [len(resp) for g in batch for resp in g.responses]
    lengths = [len(r) if g.loss_masks is None else int(sum(m)) for g in batch for r, m in
               zip(g.responses, g.loss_masks or g.responses)]
    prompt_lengths = [len(g.prompt_ids) for g in batch]
    accs = [acc for g in batch for acc in g.accs]
    token_logprobs = torch.cat([sampled_values(g, i, torch.as_tensor(lps, dtype=torch.float32).reshape(-1))
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


def sampled_values(group: RolloutGroup, index: int, values: torch.Tensor) -> torch.Tensor:
    """``values`` (per token of response ``index``) at the tokens the engine sampled."""
    mask = group.loss_mask(index)
    return values if mask is None else values[mask]


def tool_metrics(generated: list[RolloutGroup]) -> dict[str, float]:
    """:func:`tool_use_metrics` of the multi-turn responses generated this step; nothing without tools."""
    return tool_use_metrics([(use, acc) for g in generated if g.tool_use is not None
                             for use, acc in zip(g.tool_use, g.accs)])


def tool_call_counts(generated: list[RolloutGroup], tool_names: list[str]) -> dict[str, float]:
    """The counts of the calls of the responses generated this step (``tools/calls``, ``tools/failed/<kind>``,
    ``tools/<name>/calls``, ...: :func:`~dapo_megatron.tools.result.tool_counts`), read from the trajectories
    themselves, so calls made for validation or for later steps never reach them; their summed wall time, a clock
    reading, as ``timing_s/tool_calls``."""
    outcomes = [outcome for g in generated for use in (g.tool_use or []) for outcome in use.outcomes]
    counts = tool_counts(outcomes, tool_names)
    counts["timing_s/tool_calls"] = counts.pop("tools/wall_s")
    return counts


def tool_use_metrics(pairs: list[tuple[ToolUse, bool]]) -> dict[str, float]:
    """Of multi-turn responses, each with its correctness: generation turns (verl's ``num_turns/*``), tool calls,
    failed and timed-out calls per response, tool-output tokens, the share of responses that called a tool and the
    accuracy of those that did and did not (``tools/acc/with_tool``, ``tools/acc/without_tool``); training's
    numbers, and validation's under ``val/``. Nothing without responses."""
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
