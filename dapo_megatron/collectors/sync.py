"""Steps 1–4 of a DAPO step (:meth:`dapo_megatron.trainer.loop.DAPOTrainer.train_step`), on the rank that drives
the rollout engine (global rank 0):

    prompts (sampler) → G responses each (engine) → reward + overlong shaping → dynamic-sampling filter → buffer,
    repeated until the buffer holds ``trainer.train_batch_size`` groups or ``algorithm.max_gen_rounds`` is reached.

At the round cap the step trains on what it collected (possibly fewer groups) and says so in its metrics
(``train/hit_gen_round_cap``) — the reference recipe raises an error there, which kills week-long runs.

Every generate call gets a seed derived from (run seed, step, round), so a resumed run replays the exact rollouts.

The responses come from the run's :class:`~dapo_megatron.rollout.generator.RolloutGenerator` (single-turn, or
multi-turn with tools: the collector does not look behind it).
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from dapo_megatron.algorithm import DynamicSamplingBuffer, FilterStats
from dapo_megatron.config import DAPOConfig
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.reward.scorer import RewardScorer
from dapo_megatron.rollout.generator import RolloutGenerator
from dapo_megatron.collectors.group import RolloutGroup, generation_seed, sampling_params, score_groups
from dapo_megatron.collectors.rollout_metrics import rollout_metrics


class RolloutCollector:
    """Steps 1–4 in sync mode: ``collect(step)`` generates (``rollouts``), scores and filters until the batch is
    full. ``rollouts`` (which validation shares) is closed by :meth:`close`; ``reward`` by its owner, the trainer."""

    def __init__(self, rollouts: RolloutGenerator, sampler: PromptSampler, tokenizer, config: DAPOConfig,
                 reward: RewardScorer):
        self.rollouts = rollouts
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.config = config
        self.reward = reward
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
            params = sampling_params(self.config, self.tokenizer, generation_seed(t.seed, step, rounds))
            outputs = self.rollouts.generate(records, params)
            groups = score_groups(list(zip(records, outputs)), self.tokenizer, self.config, self.reward, step)
            generated.extend(groups)
            stats = stats + self.buffer.add(groups)
            rounds += 1
            progress.update(min(len(self.buffer), self.buffer.target_groups) - progress.n)
            progress.set_postfix(rounds=rounds, kept=f"{stats.kept_fraction:.2f}")
        progress.close()
        hit_cap = not self.buffer.is_full
        batch = self.buffer.drain() if hit_cap else self.buffer.pop()
        metrics = rollout_metrics(batch, generated, stats, rounds, hit_cap, self.config.rollout.max_response_length,
                                  tool_names=self.rollouts.tool_names)
        return batch, metrics

    def close(self) -> None:
        """Nothing runs in the background in sync mode; the rollout generator releases its tool pool (waiting for
        the calls running, each ends within its limit)."""
        self.rollouts.close()

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("pending_prompts"):
            raise ValueError(f"the checkpoint was written in rollout.mode=async with {len(state['pending_prompts'])} "
                             "prompts queued or in flight, which sync mode would lose: resume with rollout.mode=async")
        self.sampler.load_state_dict(state["sampler"])
        self.buffer.load_state_dict(state["buffer"])

