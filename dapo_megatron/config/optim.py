"""``optim:``: the policy's Adam optimizer, its learning-rate warmup and gradient clipping."""

from __future__ import annotations

from dataclasses import dataclass

from dapo_megatron.config.errors import require, require_finite_numbers


@dataclass
class OptimConfig:
    lr: float = 1e-6
    warmup_steps: int = 10
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0

    def validate(self) -> None:
        require_finite_numbers(self, "optim.")
        require(self.lr > 0, "optim.lr", "must be > 0")
        require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        require(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)")
