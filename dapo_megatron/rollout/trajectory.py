"""One multi-turn response as it is built, turn by turn (:class:`Trajectory`), and the :class:`Sample` it becomes.

Per token it keeps what the engine sampled exactly (ids, log-probs, the weight version that sampled it) with mask 1,
and the tools' answers with mask 0: a tool token's log-prob is 0.0 and its version that of the turn before it,
values nothing reads, since everything that reads them as sampled reads the mask first.

Routing (R3, ``algorithm.moe_routing_replay: replay_rollout``). The sample's routing is ``[P + R − 1, ...]``: the
experts of every token of prompt ‖ response but the last, by input position
(:mod:`dapo_megatron.policy.rollout_routing`).
Turn k is one engine request over the whole context so far, so its routing covers its context (its prefill) and the
tokens it sampled. The trajectory keeps, of each turn, the rows no earlier turn gave: the turn's sampled tokens as
they were routed when sampled, and — from its prefill — the previous turn's last token and the tool output before
it (verl does the same: tool-output tokens are routed when the next turn reads them). Rows no turn gave (tool output
that ends the response, which no turn read) are ``UNROUTED``: the trainer's router chooses there. Only dimension 0
(positions) is read; the rest of the layout is the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from dapo_megatron.rollout.engine import CallOutcome, Sample, ToolUse

if TYPE_CHECKING:
    import torch

    from dapo_megatron.tools.result import ToolResult

UNROUTED = -1  # = dapo_megatron.policy.rollout_routing.UNROUTED: the router chooses itself


@dataclass
class Trajectory:
    request_id: str  # the request (one prompt, n trajectories) it belongs to
    prompt_index: int
    sample_index: int
    prompt: list[int]
    metadata: dict  # what its tool calls learn of the prompt
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    use: ToolUse = field(default_factory=ToolUse)
    segment_start: int = 0  # where the model's tokens since the last tool output begin (0: with the prompt)
    finish_reason: str | None = None
    routing: list["torch.Tensor"] = field(default_factory=list)  # rows by position, in pieces
    routed_rows: int = 0
    routing_missing: bool = False  # a turn came back without routing: the sample has none

    def segment(self, end: int | None = None) -> list[int]:
        tokens = self.token_ids[self.segment_start:end]
        return self.prompt + tokens if self.segment_start == 0 else tokens

    def add_turn(self, turn: Sample, kept: int) -> None:
        """The first ``kept`` tokens the engine sampled in ``turn`` (the rest, past a call's end, are not part of
        the response), and the routing rows they bring."""
        context = len(self.prompt) + len(self.token_ids)
        if turn.routed_experts is None:
            self.routing_missing = True
        else:
            rows = turn.routed_experts[self.routed_rows:context + kept - 1]
            if len(rows):
                self.routing.append(rows)
                self.routed_rows += len(rows)
        ids = list(turn.token_ids[:kept])
        versions = (list(turn.token_versions) or [turn.weight_version] * len(turn.token_ids))[:kept]
        self._add(ids, list(turn.logprobs)[:kept], versions, sampled=True)

    def add_tool_output(self, ids: Sequence[int], result: "ToolResult", fallback_version: int) -> None:
        use = self.use
        use.failed += int(not result.ok)
        use.timeouts += int(result.kind == "timeout")
        use.outcomes.append(CallOutcome(result.tool, result.ok, result.kind, result.wall_s))
        version = self.versions[-1] if self.versions else fallback_version
        self._add(ids, [0.0] * len(ids), [version] * len(ids), sampled=False)
        use.output_tokens += len(ids)
        self.segment_start = len(self.token_ids)

    def _add(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], sampled: bool) -> None:
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
        self.mask.extend([int(sampled)] * len(ids))

    def sample(self, fallback_version: int) -> Sample:
        versions = self.versions
        return Sample(prompt_index=self.prompt_index, token_ids=self.token_ids, logprobs=self.logprobs,
                      finish_reason=self.finish_reason, weight_version=min(versions, default=fallback_version),
                      token_versions=list(versions), loss_mask=self.mask, tool_use=self.use,
                      routed_experts=self._routing())

    def _routing(self) -> "torch.Tensor | None":
        if self.routing_missing or not self.routing:
            return None
        import torch

        rows = len(self.prompt) + len(self.token_ids) - 1
        pieces = list(self.routing)
        if rows > self.routed_rows:
            last = pieces[-1]
            pieces.append(torch.full((rows - self.routed_rows, *last.shape[1:]), UNROUTED, dtype=last.dtype))
        return torch.cat(pieces)[:rows]
