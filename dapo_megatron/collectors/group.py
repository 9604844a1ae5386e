"""The scored group — the G responses to one prompt, with their rewards — that steps 2–4 produce and steps 5–7 train
on, and how a group is made: the sampling parameters of its generate call (:func:`sampling_params`, seeded per step
and round by :func:`generation_seed`) and its reward (:func:`score_groups`: the reward of
:class:`~dapo_megatron.reward.scorer.RewardScorer` — the DAPO math rule by default — plus the soft format bonus and
the soft overlong punishment). Both collectors (:mod:`.sync`, :mod:`.asynchronous`) build groups
here, and only here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dapo_megatron.reward.overlong import overlong_penalty
from dapo_megatron.algorithm.staleness import TokenVersions, response_staleness, version_span
from dapo_megatron.config import DAPOConfig
from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.reward.response_text import grouped_response_texts
from dapo_megatron.reward.scorer import RewardRequest, RewardScorer
from dapo_megatron.rollout.engine import Sample, SamplingParams, ToolUse
from dapo_megatron.collectors.reflection import ReflectionPhrases


@dataclass
class RolloutGroup:
    """The G responses to one prompt, scored. ``accs`` (exact-match correctness) drives dynamic sampling;
    ``scores`` (±1 plus the overlong penalty) drive the advantages.

    ``weight_version`` is the OLDEST weight version that sampled a token of the group, so ``weight_version == V``
    means the policy at version V sampled every token (the group is on-policy for V); staleness is counted from it
    (:mod:`dapo_megatron.algorithm.staleness`). ``token_versions`` gives each response's per-token versions when
    they differ from ``weight_version`` (a partial rollout continued across a weight update); None when every
    token was sampled by ``weight_version``.

    Per-token fields (prompt and response ids, engine log-probs, token versions) are lists as the collector scores
    them on rank 0 and tensors once the batch reached every rank (:mod:`.batch`); everything reading them
    takes either, and none walks them token by token in Python.
    """

    prompt_ids: Sequence[int]
    ground_truth: str
    data_source: str
    responses: list[Sequence[int]]
    engine_logprobs: list[Sequence[float]]
    finish_reasons: list[str]
    accs: list[bool]
    scores: list[float]
    overlong_penalties: list[float]
    weight_version: int
    token_versions: list[TokenVersions] | None = None
    # Multi-turn rollouts (rollout.tools): per response, 1 where the engine sampled the token, 0 for tool output,
    # which the loss, the rollout correction and the entropy/length statistics leave out; None: all sampled.
    loss_masks: list[Sequence[int]] | None = None
    # What the step's metrics read besides the scores (defaults: what a group scored without them looks like).
    source_name: str | None = None  # the data.train source it was drawn from
    reward_errors: int = 0  # responses whose reward raised (scored reward.error_score)
    reward_timeouts: int = 0  # responses whose reward timed out (scored reward.error_score)
    reward_extras: dict[str, list[float]] | None = None  # numeric extras of the reward's answers, per key
    format_weight: float | None = None  # the soft format bonus of this group's step (None: off)
    format_matches: list[bool] | None = None
    reflections: list[bool] | None = None  # which responses hold a reflection phrase
    tool_use: list[ToolUse] | None = None  # multi-turn: what each response did with its tools
    # algorithm.moe_routing_replay: replay_rollout: per response, the engine's int16 [P + R - 1, layers, top-k]
    # expert ids (dapo_megatron/policy/rollout_routing.py); None: the engine gave none
    routed_experts: list[torch.Tensor | None] | None = None

    @property
    def truncated(self) -> list[bool]:
        return [reason == "length" for reason in self.finish_reasons]

    def sampled_mask(self, index: int) -> torch.Tensor | None:
        """bool ``[R]`` of response ``index``: True where the engine sampled the token; None when it sampled all."""
        if self.loss_masks is None:
            return None
        return torch.as_tensor(self.loss_masks[index]).reshape(-1).to(torch.bool)

    def response_versions(self, index: int) -> TokenVersions:
        """The weight version that sampled each token of response ``index``."""
        if self.token_versions is not None:
            return self.token_versions[index]
        return torch.full((len(self.responses[index]),), self.weight_version, dtype=torch.int64)

    def response_staleness(self, index: int, policy_version: int) -> int:
        """:func:`~dapo_megatron.algorithm.staleness.response_staleness` of response ``index``; a response of one
        version is not expanded per token (the per-step metrics read every response of the batch)."""
        return response_staleness(self._distinct_versions(index), policy_version)

    def response_span(self, index: int) -> int:
        """:func:`~dapo_megatron.algorithm.staleness.version_span` of response ``index``, as cheaply."""
        return version_span(self._distinct_versions(index))

    def _distinct_versions(self, index: int) -> TokenVersions:
        if self.token_versions is not None:
            return self.token_versions[index]
        return [self.weight_version] if len(self.responses[index]) else []


def generation_seed(run_seed: int, step: int, round_index: int) -> int:
    return (run_seed * 1_000_003 + step * 1_009 + round_index) % (2**31 - 1)


def sampling_params(config: DAPOConfig, tokenizer, seed: int | None) -> SamplingParams:
    """The rollout's sampling parameters (G samples per prompt) with ``seed``."""
    r = config.rollout
    return SamplingParams(n=r.n_samples, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_response_length, stop_token_ids=(tokenizer.eos_token_id,), seed=seed)


def score_groups(drawn: list[tuple[PromptRecord, list[Sample]]], tokenizer, config: DAPOConfig,
                 reward: RewardScorer, step: int) -> list[RolloutGroup]:
    """Score the responses of each (prompt, samples) pair in one call of ``reward`` (its worker processes score all
    groups at once): score = reward (or ``reward.error_score`` when it failed) + format bonus at ``step`` (optimizer
    steps done) + overlong penalty; correctness = the reward's ``acc`` alone."""
    texts = grouped_response_texts(tokenizer, [samples for _, samples in drawn])
    outcomes = reward.score([[_request(record, text, j, len(group_texts)) for j, text in enumerate(group_texts)]
                             for (record, _), group_texts in zip(drawn, texts)])
    format_weight = reward.format.weight(step) if reward.format.enabled else None
    reflection = ReflectionPhrases(config.trainer.reflection_phrases)
    groups = []
    for (record, samples), group_texts, group_outcomes in zip(drawn, texts, outcomes):
        values = [reward.value(outcome) for outcome in group_outcomes]
        statuses = [status for status, _ in group_outcomes]
        matches = [reward.format.matches(text) for text in group_texts] if format_weight is not None else None
        bonuses = [format_weight * m for m in matches] if matches is not None else [0.0] * len(samples)
        penalties = _overlong_penalties(samples, config)
        extras: dict[str, list[float]] = {}
        for value in values:
            for key, number in value.extras.items():
                extras.setdefault(key, []).append(number)
        groups.append(RolloutGroup(
            prompt_ids=list(record.prompt_ids),
            ground_truth=record.ground_truth,
            data_source=record.data_source,
            responses=[list(s.token_ids) for s in samples],
            engine_logprobs=[list(s.logprobs) for s in samples],
            finish_reasons=[s.finish_reason for s in samples],
            accs=[v.acc for v in values],
            scores=[v.score + b + p for v, b, p in zip(values, bonuses, penalties)],
            overlong_penalties=penalties,
            **_versions(samples),
            source_name=record.source_name,
            reward_errors=statuses.count("error"),
            reward_timeouts=statuses.count("timeout"),
            reward_extras=extras or None,
            format_weight=format_weight,
            format_matches=matches,
            reflections=[reflection.found_in(text) for text in group_texts],
            **_tool_fields(samples),
            routed_experts=([s.routed_experts for s in samples]
                            if any(s.routed_experts is not None for s in samples) else None),
        ))
    return groups


def _request(record: PromptRecord, text: str, index: int, group_size: int) -> RewardRequest:
    return RewardRequest(data_source=record.data_source, solution_str=text, ground_truth=record.ground_truth,
                         extra_info=dict(record.extra_info or {"index": record.index}),
                         row=f"row index={record.index!r} of data source {record.data_source!r}, response "
                             f"{index + 1} of {group_size}")


def _tool_fields(samples: list[Sample]) -> dict:
    """Multi-turn responses' loss masks and tool use; nothing for single-turn ones (their group is as before)."""
    if all(s.loss_mask is None and s.tool_use is None for s in samples):
        return {}
    return {"loss_masks": [list(s.loss_mask) if s.loss_mask is not None else [1] * len(s.token_ids)
                           for s in samples],
            "tool_use": [s.tool_use or ToolUse() for s in samples]}


def _overlong_penalties(samples: list[Sample], config: DAPOConfig) -> list[float]:
    """The soft overlong punishment of each response, by its full length: tool output included, as the response
    budget counts it (a response long from tool output is as near the budget's cut as one long from sampling)."""
    a, r = config.algorithm, config.rollout
    if not a.overlong_penalty:
        return [0.0] * len(samples)
    lengths = torch.tensor([len(s.token_ids) for s in samples])
    return overlong_penalty(lengths, r.max_response_length, a.overlong_buffer_len, a.overlong_penalty_factor).tolist()


def _versions(samples: list[Sample]) -> dict:
    """``weight_version`` (the oldest) and, only when some token differs from it, ``token_versions``."""
    if not samples:
        return {"weight_version": -1}
    per_token = [list(s.token_versions) if s.token_versions else [s.weight_version] * len(s.token_ids)
                 for s in samples]
    oldest = min([s.weight_version for s in samples] + [v for versions in per_token for v in versions])
    mixed = any(v != oldest for versions in per_token for v in versions)
    return {"weight_version": oldest, "token_versions": per_token if mixed else None}
