"""Trainer → inference-engine weight handoff: megatron shards to full Hugging Face-named tensors, in buckets, over one
broadcast group per pipeline stage (:mod:`.stage_routes`)."""

from dapo_megatron.handoff.exporter import (
    DEFAULT_BUCKET_BYTES,
    export_hf_buckets,
    gather_hf_buckets_to_rank0,
    stream_stage_buckets,
)
from dapo_megatron.handoff.stage_routes import HandoffRoute, StageStreamReceiver, choose_route

__all__ = ["DEFAULT_BUCKET_BYTES", "HandoffRoute", "StageStreamReceiver", "choose_route", "export_hf_buckets",
           "gather_hf_buckets_to_rank0", "stream_stage_buckets"]
