"""Whether a run's steps changed the policy at all, and why not when they did not.

A step can train nothing for good reasons (every group of a batch answered alike, once in a while). A run whose
every step trained nothing is a configuration that cannot train — ``rollout.max_response_length`` too short for an
answer, a reward that fails (often enough to score groups alike, not enough for ``reward.max_error_fraction`` to
stop the run), a reward nobody earns, a task the model always solves — and a run of them would otherwise end with
exit 0 and an unchanged model. :class:`TrainingProgress` watches the steps' metrics and says so, naming the cause the
metrics show.
"""

from __future__ import annotations

from dapo_megatron.config import DAPOConfig

WARN_AFTER_STEPS = 3  # consecutive steps without an update from the start before the run warns


class TrainingProgress:
    def __init__(self, config: DAPOConfig):
        self.config = config
        self.steps = 0
        self.trained_steps = 0
        self.all_wrong = 0.0  # sums of the filter fractions over the steps that trained nothing
        self.all_right = 0.0
        self.reward_failures = 0.0  # responses whose reward failed, over the steps that trained nothing

    def note(self, metrics: dict[str, float]) -> None:
        """One step's metrics: a step trained nothing when its batch was empty (dynamic sampling kept no group) or
        its updates had no gradient (every advantage 0: each group's responses scored alike)."""
        self.steps += 1
        if metrics.get("train/skipped_empty_batch") == 1.0 or metrics.get("actor/grad_norm") == 0.0:
            self.all_wrong += metrics.get("train/filter/all_wrong_fraction", 0.0)
            self.all_right += metrics.get("train/filter/all_correct_fraction", 0.0)
            self.reward_failures += metrics.get("reward/errors", 0.0) + metrics.get("reward/timeouts", 0.0)
        else:
            self.trained_steps += 1

    def nothing_trained(self) -> str | None:
        """Why no step so far changed the policy (None when one did, or no step ran)."""
        if self.trained_steps or not self.steps:
            return None
        c = self.config
        ds = c.algorithm.dynamic_sampling
        if self.reward_failures:  # failed rewards all score reward.error_score: that is why the groups look alike
            cause = (f"the reward failed on {self.reward_failures:.0f} responses (reward/errors, reward/timeouts; the "
                     f"first failure is logged at its step)")
        elif self.all_wrong == self.steps:
            cause = (f"every response was wrong (is rollout.max_response_length={c.rollout.max_response_length} "
                     f"room enough for an answer?)")
        elif self.all_right == self.steps:
            cause = "every response was right (the task is too easy for the model)"
        else:
            cause = "in every group the responses were all right or all wrong"
        effect = "dynamic sampling kept no group" if ds else "every advantage was 0"
        return (f"no step of this run changed the policy: in each of its {self.steps} steps {cause}, so {effect} "
                f"and no update was made")
