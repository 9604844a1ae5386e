"""LoRA adapters out of megatron's shards: the whole adapter as one :class:`~dapo_megatron.hf_format.peft_adapter.
PeftAdapter` on global rank 0 (what ``model.lora.handoff: adapter`` sends an engine, and what ``checkpoint_tools``
writes as a PEFT folder), and the base weights with the adapter merged in (``handoff: merged``).

The adapter travels through the weight exporter itself (:func:`dapo_megatron.handoff.exporter.
gather_hf_buckets_to_rank0` with :func:`dapo_megatron.policy.lora.mapping.adapter_stage_mappings`): the same TP
gathers, expert-parallel gathers and per-stage broadcasts as the weights, with PEFT's names and the adapters' own
splits (``B`` like the base's output rows, ``A`` like its input columns, the other replicated).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from dapo_megatron.backend.interfaces import TensorParallelGather
from dapo_megatron.handoff.exporter import DEFAULT_BUCKET_BYTES, PROCESS_GROUP_GATHER, gather_hf_buckets_to_rank0
from dapo_megatron.hf_format.buckets import Bucket
from dapo_megatron.hf_format.peft_adapter import PeftAdapter
from dapo_megatron.policy.lora.mapping import adapter_stage_mappings
from dapo_megatron.policy.model_spec import ModelSpec


def gather_adapter_to_rank0(model: torch.nn.Module, spec: ModelSpec, *, rank: int, alpha: float, dropout: float = 0.0,
                            tp_gather: TensorParallelGather = PROCESS_GROUP_GATHER,
                            bucket_bytes: int = DEFAULT_BUCKET_BYTES, base_model: str | None = None
                            ) -> PeftAdapter | None:
    """The model's adapters, full and PEFT-named, as a :class:`PeftAdapter` (host copies) on global rank 0; None on
    every other rank. Every rank must call it (collectives)."""
    tensors: dict[str, torch.Tensor] = {}
    for bucket in gather_hf_buckets_to_rank0(model, spec, bucket_bytes=bucket_bytes, tp_gather=tp_gather,
                                             mappings=adapter_stage_mappings):
        for name, tensor in bucket:  # the bucket's memory may be reused for the next one: copies
            tensors[name] = tensor.detach().to("cpu", copy=True)
    if dist.get_rank() != 0:
        return None
    return PeftAdapter(tensors, rank=rank, alpha=alpha, dropout=dropout, base_model=base_model)


def merged_buckets(buckets: Iterator[Bucket], adapter: PeftAdapter) -> Iterator[Bucket]:
    """``buckets`` of base weights with ``adapter`` merged into the weights it is on (``W + scale · B A``, each
    bucket as it comes: one bucket of merged copies at a time)."""
    for bucket in buckets:
        yield list(adapter.merged_into(bucket))
