"""Soft format enforcement (the paper summaries' "decaying format reward"): a bonus for a response in the expected
format that fades out, so the model learns the format early without being held in a format-hacking optimum.

    bonus(response, step) = weight · max(0, 1 − step / decay_steps)   if ``pattern`` matches the response
                          = 0                                         otherwise

``step`` is the number of optimizer steps done when the response is scored. The bonus is added to the score the
advantages use; the correctness dynamic sampling filters on never sees it (filtering on a shaped reward lets the
bonus make an all-wrong group look mixed). ``weight`` 0 (the default) turns it off, as in the paper's recipe.
"""

from __future__ import annotations

import re

from dapo_megatron.config.reward import FormatRewardConfig


class FormatReward:
    def __init__(self, config: FormatRewardConfig):
        self.start_weight = config.weight
        self.decay_steps = config.decay_steps
        self.pattern = re.compile(config.pattern)

    @property
    def enabled(self) -> bool:
        return self.start_weight > 0

    def weight(self, step: int) -> float:
        """The bonus for a well-formatted response at ``step``: linear from the start weight to 0 at decay_steps."""
        return self.start_weight * max(0.0, 1.0 - step / self.decay_steps)

    def matches(self, response: str) -> bool:
        return self.pattern.search(response) is not None
