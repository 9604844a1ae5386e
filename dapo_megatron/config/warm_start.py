"""``warm_start:``: the supervised phase before RL that teaches a random tiny model the answer format."""

from __future__ import annotations

from dataclasses import dataclass

from dapo_megatron.config.errors import require_finite_numbers


@dataclass
class WarmStartConfig:
    """Supervised warm-start on reference solutions (synthetic task only): gives a random tiny model the format."""

    enabled: bool = False
    max_steps: int = 400
    batch_size: int = 128
    lr: float = 3e-3
    eval_every: int = 20
    stop_at_accuracy: float = 0.35  # stop early: RL needs groups with mixed outcomes

    def validate(self) -> None:
        """Its numbers are finite; that it needs the synthetic task is :meth:`DAPOConfig.validate`'s check."""
        require_finite_numbers(self, "warm_start.")
