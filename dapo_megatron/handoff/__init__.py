"""Trainer → inference-engine weight handoff: megatron shards to full Hugging Face-named tensors, in buckets."""

from dapo_megatron.handoff.exporter import DEFAULT_BUCKET_BYTES, export_hf_buckets, gather_hf_buckets_to_rank0

__all__ = ["DEFAULT_BUCKET_BYTES", "export_hf_buckets", "gather_hf_buckets_to_rank0"]
