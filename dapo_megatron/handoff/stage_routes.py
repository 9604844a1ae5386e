"""How a weight handoff travels from the pipeline stages to the rollout engine: one broadcast group per stage.

Each pipeline stage has one *source*, its DP-0 / TP-0 rank, which turns the stage's shards into full HF tensors
(:func:`dapo_megatron.handoff.export_hf_buckets`). Under megatron's rank order (TP fastest, PP slowest) the source
of stage ``s`` is global rank ``s · world / PP`` (:func:`stage_sources`). Each stage then reaches the engine over a
group of its own, so no stage waits for another's tensors to pass through it. Two routes (:func:`choose_route`):

* ``"per_stage"`` — the engine receives one stream per stage. It hands rank 0 a picklable
  :class:`StageStreamReceiver` (``RolloutEngine.stage_stream_receiver()``); every stage's source opens the receiver
  for its stage and streams its buckets straight into the engine over the stage's own group (for SGLang's
  ``distributed`` transport: the source and the servers' TP ranks joined per stage, as slime does); rank 0 then
  commits the version (``RolloutEngine.commit_stage_streams``). The stages stream concurrently.
* ``"gather_to_rank0"`` — the engine takes one stream on global rank 0 (the embedded engine, the disk and
  tensor transports): stage 0's buckets are rank 0's own, and every later stage's source broadcasts its buckets in
  its two-rank group {rank 0, source} (:func:`stage_broadcast_groups`), stage by stage.

With one pipeline stage both routes are the same single stream on rank 0, so it is always ``"gather_to_rank0"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Protocol

import torch.distributed as dist
from megatron.core import parallel_state

from dapo_megatron.hf_format.buckets import Bucket

HandoffRoute = Literal["per_stage", "gather_to_rank0"]


class StageStreamReceiver(Protocol):
    """An engine's per-stage entry point, built on rank 0 and sent (pickled) to every stage's source."""

    def open_stage(self, stage: int, num_stages: int) -> Callable[[Iterator[Bucket]], None]:
        """On stage ``stage``'s source: a consumer that takes that stage's buckets, one at a time, to the engine."""


def choose_route(pipeline_parallel: int, engine_takes_stage_streams: bool) -> HandoffRoute:
    """``"per_stage"`` when there are several stages and the engine can receive a stream from each; otherwise one
    stream, gathered on global rank 0."""
    if pipeline_parallel < 1:
        raise ValueError(f"pipeline_parallel must be >= 1, got {pipeline_parallel}")
    return "per_stage" if pipeline_parallel > 1 and engine_takes_stage_streams else "gather_to_rank0"


def stage_sources(world_size: int, pipeline_parallel: int) -> tuple[int, ...]:
    """Global rank of each stage's source (DP 0, TP 0) under megatron's default rank order, stage by stage."""
    if pipeline_parallel < 1 or world_size % pipeline_parallel:
        raise ValueError(f"world size {world_size} is not a multiple of pipeline_parallel={pipeline_parallel}")
    ranks_per_stage = world_size // pipeline_parallel
    return tuple(stage * ranks_per_stage for stage in range(pipeline_parallel))


@dataclass(frozen=True)
class StageGroups:
    """The stage sources and, for every stage after the first, its broadcast group {global rank 0, its source}."""

    sources: tuple[int, ...]
    groups: dict[int, dist.ProcessGroup]  # stage >= 1 → group (None for ranks outside it, as torch returns)

    def group(self, stage: int) -> dist.ProcessGroup:
        return self.groups[stage]


_built: tuple[object, StageGroups] | None = None  # (the pipeline group it was built for, the groups)


def stage_broadcast_groups() -> StageGroups:
    """The per-stage broadcast groups of the initialized megatron layout, built on first use (``new_group`` is
    collective: every rank calls this, in the same order) and kept for the life of that layout."""
    global _built

    pipeline_group = parallel_state.get_pipeline_model_parallel_group()
    if _built is not None and _built[0] is pipeline_group:
        return _built[1]
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    sources = stage_sources(dist.get_world_size(), pp)
    if dist.get_rank() in sources:
        actual = tuple(dist.get_process_group_ranks(pipeline_group))
        if actual != sources:
            raise RuntimeError(f"stage sources {actual} differ from {sources}: unexpected megatron rank order")
    groups = {stage: dist.new_group(sorted({0, sources[stage]})) for stage in range(1, pp)}
    _built = (pipeline_group, StageGroups(sources, groups))
    return _built[1]
