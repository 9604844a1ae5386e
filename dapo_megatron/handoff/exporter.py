"""megatron shards → full Hugging Face-named tensors, streamed in buckets of bounded size.

Who does what (every rank calls the same function; it returns/yields nothing on ranks with no part to play):

* Only data-parallel rank 0 takes part — DP replicas hold identical weights.
* Within each pipeline stage, the TP ranks ``gather`` each parameter's shard to TP rank 0 (the stage's *source*)
  — through shared memory when they share a host and no GPU (:mod:`dapo_megatron.handoff.shm_gather`) —
  which turns the shards into full HF tensors through :mod:`dapo_megatron.policy.weight_mapping` (QKV and fc1
  un-interleaved, vocabulary padding removed). Replicated tensors (norms) are not gathered.
* The source packs the tensors into buckets of at most ``bucket_bytes`` (a single larger tensor travels alone;
  :func:`dapo_megatron.hf_format.bucketed`) and yields them: :func:`export_hf_buckets`. Each HF name appears exactly
  once over all stages. These are the buckets a rollout engine's ``update_weights`` receives, as they are.
* :func:`gather_hf_buckets_to_rank0` additionally moves every stage's buckets to global rank 0 (stage 0's source),
  point-to-point, stage by stage, so one process can feed the inference engine.

Memory bound: a source holds one bucket plus the TP shards of one parameter (``bucket_bytes + T ×`` the largest
shard); with :func:`gather_hf_buckets_to_rank0` global rank 0 holds one received bucket at a time, and a stage's
source blocks in ``send`` until rank 0 has taken its previous bucket. Consumers must be done with a bucket before
asking for the next (its tensors may be views of one receive buffer).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist

from dapo_megatron.handoff.shm_gather import shared_memory_gather
from dapo_megatron.hf_format.buckets import Bucket, bucketed, nbytes
from dapo_megatron.policy.hf_loader import model_stage_mappings, unwrap_model
from dapo_megatron.policy.model import ModelSpec
from dapo_megatron.policy.weight_mapping import ShardGeometry, Split, hf_from_shards

DEFAULT_BUCKET_BYTES = 512 * 2**20
_ALIGN = 16  # byte alignment of each tensor inside a packed p2p buffer, so every dtype view is valid


def _is_export_source_group_member() -> bool:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0


def _gather_shards(shard: torch.Tensor) -> list[torch.Tensor] | None:
    """All TP ranks' shards on TP rank 0 (rank order), None elsewhere. ``.contiguous()``: gloo mis-scatters views."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = parallel_state.get_tensor_model_parallel_world_size()
    shard = shard.detach().contiguous()
    if size == 1:
        return [shard]
    src = parallel_state.get_tensor_model_parallel_src_rank()
    is_src = parallel_state.get_tensor_model_parallel_rank() == 0
    gathered = [torch.empty_like(shard) for _ in range(size)] if is_src else None
    dist.gather(shard, gathered, dst=src, group=group)
    return gathered


def _standalone(tensor: torch.Tensor) -> torch.Tensor:
    """A TP=1 piece as consumers may take it: a parameter that is its whole storage as it is (handing it over copies
    nothing, and serializing it sends only its bytes); any other view (q/k/v rows of the interleaved QKV weight,
    the halves of fc1, the vocabulary without its padding rows, a view into DDP's parameter buffer) as a compact
    copy of its elements."""
    whole = (tensor.is_contiguous() and tensor.storage_offset() == 0
             and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())
    return tensor if whole else tensor.clone(memory_format=torch.contiguous_format)


def _stage_hf_tensors(model: torch.nn.Module, spec: ModelSpec, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for this stage, on its TP rank 0; other TP ranks only take part in the gathers."""
    from megatron.core import parallel_state

    geometry = ShardGeometry(spec, parallel_state.get_tensor_model_parallel_world_size())
    is_source = parallel_state.get_tensor_model_parallel_rank() == 0
    params = dict(unwrap_model(model).named_parameters())
    mappings = [m for m in model_stage_mappings(model, spec) if m.exported]
    split = [params[m.megatron_name].detach() for m in mappings if m.split is not Split.REPLICATED]
    shm = shared_memory_gather(parallel_state.get_tensor_model_parallel_group(), split)  # same-host CPU ranks
    if shm is not None:
        shm.stage(split)
    number = 0
    for mapping in mappings:
        shard = params[mapping.megatron_name]
        if mapping.split is Split.REPLICATED:
            shards = [shard.detach()] * geometry.tensor_parallel
        else:
            shards = _gather_shards(shard) if shm is None else shm.shards(number, shard) if is_source else None
            number += 1
        if not is_source:
            continue
        for name, tensor in zip(mapping.hf_names, hf_from_shards(mapping, geometry, shards), strict=True):
            tensor = _standalone(tensor) if geometry.tensor_parallel == 1 else tensor.contiguous()
            yield name, tensor if dtype is None else tensor.to(dtype)
    if shm is not None:
        shm.finish()


def export_hf_buckets(model: torch.nn.Module, spec: ModelSpec, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """This pipeline stage's HF tensors in buckets of ≤ ``bucket_bytes``, yielded on the stage's source rank only.

    Every rank of the model must drain the iterator (the TP ranks of DP rank 0 take part in collectives while it
    runs). ``dtype`` casts the exported tensors (e.g. bf16 for the inference engine); default: the parameters' dtype.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if not _is_export_source_group_member():
        return
    yield from bucketed(_stage_hf_tensors(model, spec, dtype), bucket_bytes)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _send_bucket(bucket: Bucket, dst: int) -> None:
    """Metadata as an object, then all tensors packed into one byte buffer (any dtype, one transfer)."""
    meta = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
    total = sum(_aligned(nbytes(t)) for _, t in bucket)
    dist.send_object_list([(meta, total)], dst=dst)
    buffer = torch.empty(total, dtype=torch.uint8, device=bucket[0][1].device)
    offset = 0
    for _, tensor in bucket:
        n = nbytes(tensor)
        buffer[offset:offset + n].copy_(tensor.reshape(-1).view(torch.uint8))
        offset += _aligned(n)
    dist.send(buffer, dst=dst)


def _recv_bucket(src: int, device: torch.device) -> Bucket | None:
    header: list[Any] = [None]
    dist.recv_object_list(header, src=src)
    if header[0] is None:
        return None
    meta, total = header[0]
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    dist.recv(buffer, src=src)
    bucket, offset = [], 0
    for name, shape, dtype in meta:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        bucket.append((name, buffer[offset:offset + n].view(dtype).view(shape)))
        offset += _aligned(n)
    return bucket


def gather_hf_buckets_to_rank0(model: torch.nn.Module, spec: ModelSpec, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                               dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """Every stage's buckets, yielded on global rank 0 in stage order; every rank must drain it.

    Stage 0's buckets come straight from :func:`export_hf_buckets`; then each later stage's source sends its
    buckets to rank 0 one at a time (``send_object_list`` header, one packed byte buffer, a ``None`` header at the
    end of the stage). Rank 0 is stage 0's source under megatron's rank order (TP fastest, PP slowest).
    """
    from megatron.core import parallel_state

    rank = dist.get_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    is_source = (_is_export_source_group_member() and parallel_state.get_tensor_model_parallel_rank() == 0)
    if rank == 0 and not (is_source and pp_rank == 0):
        raise RuntimeError("global rank 0 is not TP 0 / DP 0 / PP 0: unexpected megatron rank order")
    buckets = export_hf_buckets(model, spec, bucket_bytes=bucket_bytes, dtype=dtype)
    if rank == 0:
        yield from buckets
        device = next(unwrap_model(model).parameters()).device
        # Rank 0's pipeline group holds, stage by stage, the ranks at the same TP/DP position: the stage sources.
        sources = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        for stage in range(1, pp_size):
            while (bucket := _recv_bucket(sources[stage], device)) is not None:
                yield bucket
        return
    for bucket in buckets:  # non-sources: drain (collectives); sources of later stages: send to rank 0
        if is_source and pp_rank > 0:
            _send_bucket(bucket, dst=0)
    if is_source and pp_rank > 0:
        dist.send_object_list([None], dst=0)
