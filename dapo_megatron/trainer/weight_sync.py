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

With LoRA (``model.lora``) :func:`sync_engine_policy` decides what travels: ``handoff: adapter`` sends the frozen base
once (the first handoff of the process, as above) and then the adapter alone, gathered on rank 0
(:func:`dapo_megatron.handoff.adapter.gather_adapter_to_rank0`), to ``engine.update_adapter``; ``handoff: merged``
sends the full weights with the adapter merged in, every time, gathered on rank 0.
* with ``copies`` (colocated servers on this node fed by CUDA IPC handles,
  :meth:`dapo_megatron.trainer.colocation.Colocation.handoff_copies`): every rank makes the same buckets on its own
  GPU, and rank 0's stream carries the other ranks' handles of them, so each server rank opens its own GPU's copy
  (:mod:`dapo_megatron.handoff.gpu_copies`).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dapo_megatron.config.model import LoRAConfig
from dapo_megatron.policy.lora.sizes import adapter_sizes
from dapo_megatron.handoff import choose_route, export_hf_buckets, gather_hf_buckets_to_rank0, stream_stage_buckets
from dapo_megatron.handoff.adapter import gather_adapter_to_rank0, merged_buckets
from dapo_megatron.handoff.gpu_copies import GpuCopies, buckets_with_copies
from dapo_megatron.backend.interfaces import TensorParallelGather
from dapo_megatron.hf_format import Bucket, nbytes
from dapo_megatron.hf_format.peft_adapter import PeftAdapter
from dapo_megatron.rank_zero import feed_rank0, run_on_rank0
from dapo_megatron.rollout.engine import RolloutEngine


class StageStreamError(RuntimeError):
    """A stage's source failed to stream its weights into the engine; raised on every rank with every message."""


class _Counted:
    """The buckets of a stream as they pass, and their bytes."""

    def __init__(self, buckets) -> None:
        self.buckets, self.bytes = buckets, 0

    def __iter__(self):
        for bucket in self.buckets:
            self.bytes += sum(nbytes(tensor) for _, tensor in bucket)
            yield bucket


def sync_engine_weights(model: torch.nn.Module, spec, engine: RolloutEngine | None, *, version: int,
                        bucket_bytes: int, tp_gather: TensorParallelGather, merging: bool = False,
                        adapter: PeftAdapter | None = None, copies: GpuCopies | None = None) -> int:
    """Hand ``model``'s weights (this rank's stage shard; DDP-wrapped or not) to ``engine`` as ``version``.
    ``engine`` is the rollout engine on global rank 0 and None on every other rank; ``tp_gather`` is the backend's
    (:mod:`dapo_megatron.handoff.tp_gather`). ``merging`` (every rank): merge rank 0's LoRA ``adapter`` into the
    weights on the way (they are then gathered on rank 0 whatever the engine offers). ``copies``: this rank's part in
    a handoff with a copy on every GPU (not with ``merging``). Returns the bytes rank 0 sent (gathered route; 0
    elsewhere and with ``copies``, which send handles, not bytes)."""
    if copies is not None and not merging:
        buckets = buckets_with_copies(export_hf_buckets(model, spec, bucket_bytes=bucket_bytes, every_rank=True),
                                      copies)
        feed_rank0(buckets, lambda stream: engine.update_weights(stream, version),
                   what=f"weight handoff (version {version})")
        return 0
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    receiver = None
    if stages > 1 and not merging:
        receiver = run_on_rank0(lambda: engine.stage_stream_receiver(), what="asking the engine for its stage receiver")
    if choose_route(stages, receiver is not None) == "gather_to_rank0":
        buckets: Iterator[Bucket] = gather_hf_buckets_to_rank0(model, spec, bucket_bytes=bucket_bytes,
                                                               tp_gather=tp_gather)
        counted = _Counted(merged_buckets(buckets, adapter) if merging and adapter is not None else buckets)
        feed_rank0(iter(counted), lambda stream: engine.update_weights(stream, version),
                   what=f"weight handoff (version {version})")
        return counted.bytes
    error = stream_stage_buckets(model, spec, receiver, bucket_bytes=bucket_bytes, tp_gather=tp_gather)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [message for message in errors if message]
    if failed:
        raise StageStreamError(f"weight handoff (version {version}) failed: " + "; ".join(failed))
    run_on_rank0(lambda: engine.commit_stage_streams(version), what=f"committing weight version {version}",
                 broadcast_result=False)
    return 0


def sync_engine_policy(model: torch.nn.Module, spec, engine: RolloutEngine | None, *, version: int, lora: LoRAConfig,
                       base_served: bool, bucket_bytes: int, tp_gather: TensorParallelGather,
                       copies: GpuCopies | None = None) -> int:
    """The policy as ``version`` to ``engine``: its weights (:func:`sync_engine_weights`), or with LoRA what
    ``lora.handoff`` says (the module docstring); ``base_served``: the engine holds the frozen base already (an
    earlier handoff of this process sent it); ``copies``: as :func:`sync_engine_weights`. Returns the bytes rank 0
    sent (0 on the other ranks)."""
    if not lora.enabled:
        return sync_engine_weights(model, spec, engine, version=version, bucket_bytes=bucket_bytes,
                                   tp_gather=tp_gather, copies=copies)
    adapter = gather_adapter_to_rank0(model, spec, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                      tp_gather=tp_gather, bucket_bytes=bucket_bytes)
    if lora.handoff == "merged":
        return sync_engine_weights(model, spec, engine, version=version, bucket_bytes=bucket_bytes,
                                   tp_gather=tp_gather, merging=True, adapter=adapter)
    sent = 0 if base_served else sync_engine_weights(model, spec, engine, version=version, bucket_bytes=bucket_bytes,
                                                     tp_gather=tp_gather, copies=copies)
    run_on_rank0(lambda: engine.update_adapter(adapter, version), what=f"adapter handoff (version {version})",
                 broadcast_result=False)
    return sent + (adapter.nbytes if adapter is not None else 0)



def handoff_metrics(handoff_bytes: int | None, spec, lora: LoRAConfig, *, element_bytes: int) -> dict[str, float]:
    """``handoff/bytes`` (what the last handoff sent, measured on rank 0) and with LoRA the adapters' share of the
    model: ``lora/trainable_fraction`` (trained parameters / the model's) and ``lora/handoff_fraction`` (the bytes
    sent / the full weights' at ``element_bytes`` each: what a handoff without LoRA sends)."""
    metrics = {"handoff/bytes": float(handoff_bytes or 0)}
    if lora.enabled:
        sizes = adapter_sizes(spec, rank=lora.rank, target_modules=lora.target_modules)
        metrics.update({"lora/trainable_params": float(sizes.trainable),
                        "lora/trainable_fraction": sizes.trainable_fraction,
                        "lora/handoff_fraction": (handoff_bytes or 0) / (sizes.model * element_bytes)})
    return metrics
