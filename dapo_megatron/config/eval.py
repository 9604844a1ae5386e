"""``eval:``: validation during training, avg@k on the held-out problems (``data.val_files``)."""

from __future__ import annotations

from dataclasses import dataclass

from dapo_megatron.config.errors import require, require_finite_numbers


@dataclass
class EvalConfig:
    """Validation. ``n_samples`` is k of avg@k: responses per validation problem, whose mean correctness is the
    problem's score (not ``rollout.n_samples``, the group size G of the training prompts)."""

    every: int = 10  # steps; 0: only before and after training
    n_samples: int = 32  # k of avg@k: responses per validation problem
    temperature: float = 1.0
    top_p: float = 0.7
    max_response_length: int | None = None  # default: rollout.max_response_length
    greedy: bool = False  # k = 1 greedy decoding instead (the CPU demo's held-out accuracy)
    max_problems: int | None = None
    log_generations: int = 8  # generations (prompt, response, answer, score) kept per validation; 0: none

    def validate(self) -> None:
        require_finite_numbers(self, "eval.")
        require(self.log_generations >= 0, "eval.log_generations", "must be >= 0")
