"""The policy's current weights → the rollout engine (step 8 of a DAPO step, and the start of every run and eval).

Every rank calls :func:`sync_engine_weights`. The route (:mod:`dapo_megatron.handoff.stage_routes`) depends on the
engine, which lives on global rank 0: with several pipeline stages rank 0 asks it for a per-stage receiver and shares
the answer.

* ``gather_to_rank0`` (every engine today): the TP ranks gather shards and the later stages broadcast theirs to
  global rank 0 in their own groups while rank 0 reads the stream
  (:func:`dapo_megatron.handoff.gather_hf_buckets_to_rank0`) and feeds it to its engine. If the engine fails
  part-way on rank 0, rank 0 still reads the stream to its end (the other ranks' gathers and broadcasts are matched)
  and every rank raises the same :class:`dapo_megatron.rank_zero.Rank0Error`.
* ``per_stage``: every stage's source streams its own buckets into the engine's receiver
  (:func:`dapo_megatron.handoff.stream_stage_buckets`); the sources' errors are shared, then rank 0 commits the
  version (``engine.commit_stage_streams``).
* with ``copies`` (colocated servers on this node fed by CUDA IPC handles,
  :meth:`dapo_megatron.trainer.colocation.Colocation.handoff_copies`): every rank makes the same buckets on its own
  GPU, and rank 0's stream carries the other ranks' handles of them, so each server rank opens its own GPU's copy
  (:mod:`dapo_megatron.handoff.gpu_copies`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dapo_megatron.handoff import choose_route, export_hf_buckets, gather_hf_buckets_to_rank0, stream_stage_buckets
from dapo_megatron.handoff.gpu_copies import GpuCopies, buckets_with_copies
from dapo_megatron.backend.interfaces import TensorParallelGather
from dapo_megatron.rank_zero import feed_rank0, run_on_rank0
from dapo_megatron.rollout.engine import RolloutEngine


class StageStreamError(RuntimeError):
    """A stage's source failed to stream its weights into the engine; raised on every rank with every message."""


def sync_engine_weights(model: torch.nn.Module, spec, engine: RolloutEngine | None, *, version: int,
                        bucket_bytes: int, tp_gather: TensorParallelGather, copies: GpuCopies | None = None) -> None:
    """Hand ``model``'s weights (this rank's stage shard; DDP-wrapped or not) to ``engine`` as ``version``.
    ``engine`` is the rollout engine on global rank 0 and None on every other rank; ``tp_gather`` is the backend's
    (:mod:`dapo_megatron.handoff.tp_gather`); ``copies``: this rank's part in a handoff with a copy on every GPU."""
    if copies is not None:
        buckets = buckets_with_copies(export_hf_buckets(model, spec, bucket_bytes=bucket_bytes, every_rank=True),
                                      copies)
        feed_rank0(buckets, lambda stream: engine.update_weights(stream, version),
                   what=f"weight handoff (version {version})")
        return
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    receiver = None
    if stages > 1:
        receiver = run_on_rank0(lambda: engine.stage_stream_receiver(), what="asking the engine for its stage receiver")
    if choose_route(stages, receiver is not None) == "gather_to_rank0":
        buckets = gather_hf_buckets_to_rank0(model, spec, bucket_bytes=bucket_bytes, tp_gather=tp_gather)
        feed_rank0(buckets, lambda stream: engine.update_weights(stream, version),
                   what=f"weight handoff (version {version})")
        return
    error = stream_stage_buckets(model, spec, receiver, bucket_bytes=bucket_bytes, tp_gather=tp_gather)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [message for message in errors if message]
    if failed:
        raise StageStreamError(f"weight handoff (version {version}) failed: " + "; ".join(failed))
    run_on_rank0(lambda: engine.commit_stage_streams(version), what=f"committing weight version {version}",
                 broadcast_result=False)

