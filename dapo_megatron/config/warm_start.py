"""``warm_start:``: the supervised phase before RL that teaches a random tiny model the answer format."""

from __future__ import annotations

from dataclasses import dataclass

from dapo_megatron.config.errors import require, require_finite_numbers


@dataclass
class WarmStartConfig:
    """Supervised warm-start on reference solutions (synthetic task only): gives a random tiny model the format."""

    enabled: bool = False
    max_steps: int = 400
    batch_size: int = 128
    lr: float = 3e-3
    eval_every: int = 20
    stop_at_accuracy: float = 0.35  # stop early: RL needs groups with mixed outcomes
    # Your own reference responses instead of the synthetic task's: a JSONL file of multi-turn traces (a DAPO row
    # plus its "response" turns; dapo_megatron/tiny_model/traces.py), e.g. tool calls in the run's call format.
    traces: str | None = None
    # On the tool task with tools on: the share of the reference responses that call the tool (a seeded draw of the
    # problems); the rest answer directly, as a model that has not yet learnt when its tool helps. RL then teaches it
    # to call (examples/tiny_cpu_tools.yaml: 0.25).
    tool_trace_fraction: float = 1.0

    def validate(self) -> None:
        """Its numbers are finite; that it needs reference solutions (the synthetic task's, or ``traces``) is
        :meth:`DAPOConfig.validate`'s check."""
        require_finite_numbers(self, "warm_start.")
        require(self.traces is None or bool(self.traces.strip()), "warm_start.traces",
                "must be the path of a JSONL file of traces, or null")
        require(0.0 <= self.tool_trace_fraction <= 1.0, "warm_start.tool_trace_fraction",
                f"must be in [0, 1], got {self.tool_trace_fraction}")
