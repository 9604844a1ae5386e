"""Steps 1–4 of a DAPO step (:meth:`dapo_megatron.trainer.loop.DAPOTrainer.train_step`), on the rank that drives
the rollout engine (global rank 0):

    prompts (sampler) → G responses each (engine) → reward + overlong shaping → dynamic-sampling filter → buffer,
    repeated until the buffer holds ``trainer.train_batch_size`` groups or ``algorithm.max_gen_rounds`` is reached.

At the round cap the step trains on what it collected (possibly fewer groups) and says so in its metrics
(``train/hit_gen_round_cap``) — the reference recipe raises an error there, which kills week-long runs.

Every generate call gets a seed derived from (run seed, step, round), so a resumed run replays the exact rollouts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dapo_megatron.algorithm import DynamicSamplingBuffer, FilterStats, math_reward, overlong_penalty
from dapo_megatron.algorithm.staleness import response_staleness, version_span
from dapo_megatron.config import DAPOConfig
from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.rollout.engine import RolloutEngine, Sample, SamplingParams
from dapo_megatron.trainer.step_metrics import rollout_metrics


@dataclass
class RolloutGroup:
    """The G responses to one prompt, scored. ``accs`` (exact-match correctness) drives dynamic sampling;
    ``scores`` (±1 plus the overlong penalty) drive the advantages.

    ``weight_version`` is the OLDEST weight version that sampled a token of the group, so ``weight_version == V``
    means the policy at version V sampled every token (the group is on-policy for V); staleness is counted from it
    (:mod:`dapo_megatron.algorithm.staleness`). ``token_versions`` gives each response's per-token versions when
    they differ from ``weight_version`` (a partial rollout continued across a weight update); None when every
    token was sampled by ``weight_version``.
    """

    prompt_ids: list[int]
    ground_truth: str
    data_source: str
    responses: list[list[int]]
    engine_logprobs: list[list[float]]
    finish_reasons: list[str]
    accs: list[bool]
    scores: list[float]
    overlong_penalties: list[float]
    weight_version: int
    token_versions: list[list[int]] | None = None

    @property
    def truncated(self) -> list[bool]:
        return [reason == "length" for reason in self.finish_reasons]

    def response_versions(self, index: int) -> list[int]:
        """The weight version that sampled each token of response ``index``."""
        if self.token_versions is not None:
            return self.token_versions[index]
        return [self.weight_version] * len(self.responses[index])

    def response_staleness(self, index: int, policy_version: int) -> int:
        """:func:`~dapo_megatron.algorithm.staleness.response_staleness` of response ``index``; a response of one
        version is not expanded per token (the per-step metrics read every response of the batch)."""
        return response_staleness(self._distinct_versions(index), policy_version)

    def response_span(self, index: int) -> int:
        """:func:`~dapo_megatron.algorithm.staleness.version_span` of response ``index``, as cheaply."""
        return version_span(self._distinct_versions(index))

    def _distinct_versions(self, index: int) -> list[int]:
        if self.token_versions is not None:
            return self.token_versions[index]
        return [self.weight_version] if self.responses[index] else []


def generation_seed(run_seed: int, step: int, round_index: int) -> int:
    return (run_seed * 1_000_003 + step * 1_009 + round_index) % (2**31 - 1)


def sampling_params(config: DAPOConfig, tokenizer, seed: int | None) -> SamplingParams:
    """The rollout's sampling parameters (G samples per prompt) with ``seed``."""
    r = config.rollout
    return SamplingParams(n=r.n_samples, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_response_length, stop_token_ids=(tokenizer.eos_token_id,), seed=seed)


def score_group(record: PromptRecord, samples: list[Sample], tokenizer, config: DAPOConfig) -> RolloutGroup:
    a, r = config.algorithm, config.rollout
    accs, base_scores = [], []
    for sample in samples:
        text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        result = math_reward(text, record.ground_truth, use_math_verify=a.use_math_verify)
        accs.append(result.acc)
        base_scores.append(result.score)
    lengths = torch.tensor([len(s.token_ids) for s in samples])
    if a.overlong_penalty:
        penalties = overlong_penalty(lengths, r.max_response_length, a.overlong_buffer_len,
                                     a.overlong_penalty_factor).tolist()
    else:
        penalties = [0.0] * len(samples)
    return RolloutGroup(
        prompt_ids=list(record.prompt_ids),
        ground_truth=record.ground_truth,
        data_source=record.data_source,
        responses=[list(s.token_ids) for s in samples],
        engine_logprobs=[list(s.logprobs) for s in samples],
        finish_reasons=[s.finish_reason for s in samples],
        accs=accs,
        scores=[b + p for b, p in zip(base_scores, penalties)],
        overlong_penalties=penalties,
        **_versions(samples),
    )


def _versions(samples: list[Sample]) -> dict:
    """``weight_version`` (the oldest) and, only when some token differs from it, ``token_versions``."""
    if not samples:
        return {"weight_version": -1}
    per_token = [list(s.token_versions) if s.token_versions else [s.weight_version] * len(s.token_ids)
                 for s in samples]
    oldest = min([s.weight_version for s in samples] + [v for versions in per_token for v in versions])
    mixed = any(v != oldest for versions in per_token for v in versions)
    return {"weight_version": oldest, "token_versions": per_token if mixed else None}


class RolloutCollector:
    def __init__(self, engine: RolloutEngine, sampler: PromptSampler, tokenizer, config: DAPOConfig):
        self.engine = engine
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.config = config
        a = config.algorithm
        self.buffer = DynamicSamplingBuffer(config.trainer.train_batch_size,
                                            surplus_policy=a.resolved_surplus_policy, filter_groups=a.dynamic_sampling)

    def collect(self, step: int) -> tuple[list[RolloutGroup], dict[str, float]]:
        a, t = self.config.algorithm, self.config.trainer
        # Without dynamic sampling a step generates for exactly one batch of prompts, as GRPO does.
        prompts_per_round = a.gen_batch_size if a.dynamic_sampling else t.train_batch_size
        stats = FilterStats()
        generated: list[RolloutGroup] = []
        rounds = 0
        progress = tqdm(total=self.buffer.target_groups, desc=f"step {step + 1} rollouts", unit="group",
                        leave=False, disable=not sys.stderr.isatty())
        progress.update(len(self.buffer))
        while not self.buffer.is_full and rounds < a.max_gen_rounds:
            records = self.sampler.next_batch(prompts_per_round)
            outputs = self.engine.generate([r.prompt_ids for r in records],
                                           sampling_params(self.config, self.tokenizer,
                                                           generation_seed(t.seed, step, rounds)))
            groups = [score_group(rec, samples, self.tokenizer, self.config) for rec, samples in zip(records, outputs)]
            generated.extend(groups)
            stats = stats + self.buffer.add(groups)
            rounds += 1
            progress.update(min(len(self.buffer), self.buffer.target_groups) - progress.n)
            progress.set_postfix(rounds=rounds, kept=f"{stats.kept_fraction:.2f}")
        progress.close()
        hit_cap = not self.buffer.is_full
        batch = self.buffer.drain() if hit_cap else self.buffer.pop()
        return batch, rollout_metrics(batch, generated, stats, rounds, hit_cap, self.config.rollout.max_response_length)

    def close(self) -> None:
        """Nothing runs in the background in sync mode."""

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("pending_prompts"):
            raise ValueError(f"the checkpoint was written in rollout.mode=async with {len(state['pending_prompts'])} "
                             "prompts queued or in flight, which sync mode would lose: resume with rollout.mode=async")
        self.sampler.load_state_dict(state["sampler"])
        self.buffer.load_state_dict(state["buffer"])
