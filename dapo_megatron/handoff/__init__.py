"""Trainer → inference-engine weight handoff: megatron shards to full Hugging Face-named tensors."""

from dapo_megatron.handoff.exporter import (
    DEFAULT_BUCKET_BYTES,
    export_hf_buckets,
    export_hf_state_dict_to_dir,
    gather_hf_buckets_to_rank0,
    iter_hf_tensors,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "export_hf_buckets",
    "export_hf_state_dict_to_dir",
    "gather_hf_buckets_to_rank0",
    "iter_hf_tensors",
]
