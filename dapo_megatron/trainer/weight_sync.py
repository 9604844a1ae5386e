"""The policy's current weights → the rollout engine (step 8 of a DAPO step, and the start of every run and eval).

Every rank calls :func:`sync_engine_weights`: the TP ranks gather shards and the pipeline stages send theirs to global
rank 0 while rank 0 reads the stream (:func:`dapo_megatron.handoff.gather_hf_buckets_to_rank0`) and feeds it to its
engine. If the engine fails part-way on rank 0, rank 0 still reads the stream to its end (the other ranks' gathers
and sends are matched) and every rank raises the same :class:`dapo_megatron.rank_zero.Rank0Error`.
"""

from __future__ import annotations

import torch

from dapo_megatron.rank_zero import feed_rank0
from dapo_megatron.rollout.engine import RolloutEngine


def sync_engine_weights(model: torch.nn.Module, spec, engine: RolloutEngine | None, *, version: int,
                        bucket_bytes: int) -> None:
    """Hand ``model``'s weights (this rank's stage shard; DDP-wrapped or not) to ``engine`` as ``version``.
    ``engine`` is the rollout engine on global rank 0 and None on every other rank."""
    from dapo_megatron.handoff import gather_hf_buckets_to_rank0

    buckets = gather_hf_buckets_to_rank0(model, spec, bucket_bytes=bucket_bytes)
    feed_rank0(buckets, lambda stream: engine.update_weights(stream, version),
               what=f"weight handoff (version {version})")
