"""megatron shards → full Hugging Face-named tensors, streamed in buckets of bounded size.

Who does what (every rank calls the same function; it returns/yields nothing on ranks with no part to play):

* Only data-parallel rank 0 takes part — DP replicas hold identical weights.
* Within each pipeline stage, the TP ranks gather each parameter's shard to TP rank 0 (the stage's *source*) — with
  the backend's :class:`~dapo_megatron.backend.interfaces.TensorParallelGather` (``tp_gather``; default: one
  process-group ``gather`` per parameter) — which turns the shards into full HF tensors through
  :mod:`dapo_megatron.policy.weight_mapping` (QKV and fc1
  un-interleaved, vocabulary padding removed). Replicated tensors (norms) are not gathered.
* A mixture-of-experts layer's experts live on the expert-parallel ranks (carved out of the DP ranks): the ranks of
  one expert replica (expert-DP rank 0) take part too. For each local expert slot, one gather over the expert
  TP × EP group (:func:`megatron.core.parallel_state.get_expert_tensor_and_model_parallel_group`, whose rank 0 is the
  stage's source) brings that slot's shards of every EP rank to the source, which yields the EP experts one at a
  time: the source holds one parameter of EP experts, never a layer's worth, and no rank the whole model.
  :func:`stage_export_mappings` is the order the HF tensors come out in (dense ones, then the experts).
* The source packs the tensors into buckets of at most ``bucket_bytes`` (a single larger tensor travels alone;
  :func:`dapo_megatron.hf_format.bucketed`) and yields them: :func:`export_hf_buckets`. Each HF name appears exactly
  once over all stages. These are the buckets a rollout engine's ``update_weights`` receives, as they are.
* :func:`gather_hf_buckets_to_rank0` additionally moves every stage's buckets to global rank 0 (stage 0's source),
  each later stage broadcasting in its own group {rank 0, its source}, stage by stage, so one process can feed the
  inference engine; :func:`stream_stage_buckets` instead hands each stage's buckets to the engine's per-stage
  receiver on the stage's own source (the two routes: :mod:`dapo_megatron.handoff.stage_routes`).
* ``every_rank``: every rank of the model makes the same buckets on its own device (each parameter all-gathered
  over its TP and expert TP × EP groups; DP replicas export their own identical copies), which is what a handoff
  handing each GPU's copy to a colocated server on that GPU needs (:mod:`dapo_megatron.handoff.gpu_copies`). One
  pipeline stage only: a rank holds its stage's layers.
* With ``overlap_param_gather`` the distributed optimizer leaves the updated parameters sharded over DP until the
  next training forward gathers them: every export first finishes that gather
  (:func:`dapo_megatron.policy.optimizer.sync_params`), or it would export stale weights.

Memory bound: a source holds one bucket plus the TP shards of one parameter (``bucket_bytes + T ×`` the largest
shard); with :func:`gather_hf_buckets_to_rank0` global rank 0 holds one received bucket at a time, and a stage's
source blocks in its broadcast until rank 0 has taken its previous bucket. Consumers must be done with a bucket
before asking for the next (its tensors may be views of one receive buffer).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dapo_megatron.backend.interfaces import TensorParallelGather
from dapo_megatron.handoff.stage_routes import StageStreamReceiver, stage_broadcast_groups
from dapo_megatron.handoff.tp_gather import ProcessGroupAllGather, ProcessGroupGather
from dapo_megatron.hf_format.buckets import Bucket, bucketed, nbytes
from dapo_megatron.policy.hf_loader import model_stage_mappings, unwrap_model
from dapo_megatron.policy.model_spec import ModelSpec
from dapo_megatron.policy.optimizer import sync_params
from dapo_megatron.policy.weight_mapping import BoundMapping, ShardGeometry, Split, hf_from_shards, with_expert

DEFAULT_BUCKET_BYTES = 512 * 2**20
PROCESS_GROUP_GATHER = ProcessGroupGather()
PROCESS_GROUP_ALL_GATHER = ProcessGroupAllGather()
_ALIGN = 16  # byte alignment of each tensor inside a packed p2p buffer, so every dtype view is valid


def _is_export_source_group_member() -> bool:
    return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0


def _is_expert_export_member(spec: ModelSpec) -> bool:
    """Holds experts of the replica that is exported (expert-DP rank 0): every EP rank of it takes part."""
    return spec.moe is not None and parallel_state.get_expert_data_parallel_rank() == 0


StageMappings = Callable[[torch.nn.Module, ModelSpec], list[BoundMapping]]
"""Which parameters an export moves: the model's HF weights (:func:`model_stage_mappings`, the default) or its LoRA
adapters (:func:`dapo_megatron.policy.lora.mapping.adapter_stage_mappings`)."""


def _split_mappings(model: torch.nn.Module, spec: ModelSpec, mappings: StageMappings = model_stage_mappings
                    ) -> tuple[list[BoundMapping], list[BoundMapping]]:
    """This stage's exported mappings: (the dense ones, this rank's experts), each in model order."""
    mappings = [m for m in mappings(model, spec) if m.exported]
    return [m for m in mappings if m.expert is None], [m for m in mappings if m.expert is not None]


def _local_experts(spec: ModelSpec) -> int:
    return spec.moe.num_experts // parallel_state.get_expert_model_parallel_world_size()


def stage_export_mappings(model: torch.nn.Module, spec: ModelSpec) -> list[BoundMapping]:
    """Every mapping this pipeline stage exports, in the order the HF tensors come out: the dense ones, then for each
    local expert parameter the same parameter of every EP rank's expert in that slot (EP rank order)."""
    dense, experts = _split_mappings(model, spec)
    if not experts:
        return dense
    local, ep_rank = _local_experts(spec), parallel_state.get_expert_model_parallel_rank()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    return dense + [with_expert(m, rank * local + m.expert - ep_rank * local)
                    for m in experts for rank in range(ep_size)]


def _standalone(tensor: torch.Tensor) -> torch.Tensor:
    """A TP=1 piece as consumers may take it: a parameter that is its whole storage as it is (handing it over copies
    nothing, and serializing it sends only its bytes); any other view (q/k/v rows of the interleaved QKV weight,
    the halves of fc1, the vocabulary without its padding rows, a view into DDP's parameter buffer) as a compact
    copy of its elements."""
    whole = (tensor.is_contiguous() and tensor.storage_offset() == 0
             and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())
    return tensor if whole else tensor.clone(memory_format=torch.contiguous_format)


def _full_tensors(mapping: BoundMapping, geometry: ShardGeometry, shards: list[torch.Tensor],
                  dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in zip(mapping.hf_names, hf_from_shards(mapping, geometry, shards), strict=True):
        tensor = _standalone(tensor) if geometry.tensor_parallel == 1 else tensor.contiguous()
        yield name, tensor if dtype is None else tensor.to(dtype)


def _stage_hf_tensors(model: torch.nn.Module, spec: ModelSpec, dtype: torch.dtype | None,
                      tp_gather: TensorParallelGather, mappings: StageMappings = model_stage_mappings,
                      every_rank: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for this stage, on its source (TP rank 0 of DP rank 0), in
    :func:`stage_export_mappings` order; the other members only take part in the gathers. ``every_rank``: on every
    rank, the gathers all-gathers."""
    params = dict(unwrap_model(model).named_parameters())
    dense, experts = _split_mappings(model, spec, mappings)
    if every_rank or _is_export_source_group_member():
        yield from _dense_hf_tensors(dense, params, spec, dtype, tp_gather, every_rank)
    if experts and (every_rank or _is_expert_export_member(spec)):
        yield from _expert_hf_tensors(experts, params, spec, dtype, tp_gather, every_rank)


def _dense_hf_tensors(mappings: list[BoundMapping], params: dict, spec: ModelSpec, dtype: torch.dtype | None,
                      tp_gather: TensorParallelGather, every_rank: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The non-expert tensors: TP shards gathered to TP rank 0 (norms and the router are replicated)."""
    geometry = ShardGeometry(spec, parallel_state.get_tensor_model_parallel_world_size())
    is_source = every_rank or parallel_state.get_tensor_model_parallel_rank() == 0
    tp_gather = PROCESS_GROUP_ALL_GATHER if every_rank else tp_gather
    split = [params[m.megatron_name].detach() for m in mappings if m.split is not Split.REPLICATED]
    gather = tp_gather.open(parallel_state.get_tensor_model_parallel_group(), split)
    number = 0
    for mapping in mappings:
        shard = params[mapping.megatron_name]
        if mapping.split is Split.REPLICATED:
            shards = [shard.detach()] * geometry.tensor_parallel
        else:
            shards = gather.shards(number, shard.detach())
            number += 1
        if is_source:
            yield from _full_tensors(mapping, geometry, shards, dtype)
    gather.finish()


def _expert_hf_tensors(mappings: list[BoundMapping], params: dict, spec: ModelSpec, dtype: torch.dtype | None,
                       tp_gather: TensorParallelGather, every_rank: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The experts: each local slot's shards of every EP rank gathered over the expert TP × EP group to its rank 0
    (the stage's source), which yields them expert by expert."""
    group = parallel_state.get_expert_tensor_and_model_parallel_group()
    geometry = ShardGeometry(spec, parallel_state.get_expert_tensor_parallel_world_size())
    # (expert-TP rank, EP rank) of every group rank: the source sorts each EP rank's TP shards out of the gather
    coordinates: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(coordinates, (parallel_state.get_expert_tensor_parallel_rank(),
                                         parallel_state.get_expert_model_parallel_rank()), group=group)
    is_source = every_rank or dist.get_rank(group) == 0
    if not every_rank and is_source and not (_is_export_source_group_member()
                                             and parallel_state.get_tensor_model_parallel_rank() == 0):
        raise RuntimeError("rank 0 of the expert TP x EP group is not the stage's export source: unexpected "
                           "megatron rank order")
    ep_size, local = parallel_state.get_expert_model_parallel_world_size(), _local_experts(spec)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    tp_gather = PROCESS_GROUP_ALL_GATHER if every_rank else tp_gather
    gather = tp_gather.open(group, [params[m.megatron_name].detach() for m in mappings])
    for number, mapping in enumerate(mappings):
        shards = gather.shards(number, params[mapping.megatron_name].detach())
        if not is_source:
            continue
        slot = mapping.expert - ep_rank * local
        for rank in range(ep_size):
            owned = sorted(((tp, shard) for (tp, ep), shard in zip(coordinates, shards, strict=True) if ep == rank),
                           key=lambda pair: pair[0])
            yield from _full_tensors(with_expert(mapping, rank * local + slot), geometry,
                                     [shard for _, shard in owned], dtype)
    gather.finish()


def export_hf_buckets(model: torch.nn.Module, spec: ModelSpec, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      dtype: torch.dtype | None = None, tp_gather: TensorParallelGather = PROCESS_GROUP_GATHER,
                      mappings: StageMappings = model_stage_mappings, every_rank: bool = False) -> Iterator[Bucket]:
    """This pipeline stage's HF tensors in buckets of ≤ ``bucket_bytes``, yielded on the stage's source rank only
    (``every_rank``: the same buckets on every rank, see the module docstring).

    Every rank of the model must drain the iterator (the TP ranks of DP rank 0 take part in collectives while it
    runs). ``dtype`` casts the exported tensors (e.g. bf16 for the inference engine); default: the parameters' dtype.
    ``tp_gather``: how the TP shards reach the source (the backend's; see :mod:`dapo_megatron.handoff.tp_gather`).
    ``mappings``: which parameters (:data:`StageMappings`).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if every_rank and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("export_hf_buckets(every_rank=True) needs one pipeline stage: a rank holds its stage's layers")
    sync_params(model)  # every DP rank takes part; a no-op unless overlap_param_gather deferred the gather
    if not (every_rank or _is_export_source_group_member() or _is_expert_export_member(spec)):
        return
    yield from bucketed(_stage_hf_tensors(model, spec, dtype, tp_gather, mappings, every_rank), bucket_bytes)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _broadcast_bucket(bucket: Bucket | None, src: int, group) -> None:
    """From ``src`` (a stage source): metadata as an object (None ends the stage), then every tensor packed into one
    byte buffer (any dtype, one transfer)."""
    meta = None if bucket is None else ([(name, tuple(t.shape), t.dtype) for name, t in bucket],
                                        sum(_aligned(nbytes(t)) for _, t in bucket))
    dist.broadcast_object_list([meta], src=src, group=group)
    if bucket is None:
        return
    buffer = torch.empty(meta[1], dtype=torch.uint8, device=bucket[0][1].device)
    offset = 0
    for _, tensor in bucket:
        n = nbytes(tensor)
        buffer[offset:offset + n].copy_(tensor.reshape(-1).view(torch.uint8))
        offset += _aligned(n)
    dist.broadcast(buffer, src=src, group=group)


def _receive_bucket(src: int, group, device: torch.device) -> Bucket | None:
    header: list[Any] = [None]
    dist.broadcast_object_list(header, src=src, group=group)
    if header[0] is None:
        return None
    meta, total = header[0]
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    bucket, offset = [], 0
    for name, shape, dtype in meta:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        bucket.append((name, buffer[offset:offset + n].view(dtype).view(shape)))
        offset += _aligned(n)
    return bucket


def _this_stage_source() -> tuple[bool, int, int]:
    """(is this rank its stage's source, its stage, the number of stages)."""

    is_source = _is_export_source_group_member() and parallel_state.get_tensor_model_parallel_rank() == 0
    return (is_source, parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size())


def gather_hf_buckets_to_rank0(model: torch.nn.Module, spec: ModelSpec, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                               dtype: torch.dtype | None = None,
                               tp_gather: TensorParallelGather = PROCESS_GROUP_GATHER,
                               mappings: StageMappings = model_stage_mappings) -> Iterator[Bucket]:
    """Every stage's buckets, yielded on global rank 0 in stage order; every rank must drain it.

    Stage 0's buckets come straight from :func:`export_hf_buckets`; then each later stage's source broadcasts its
    buckets in the stage's group {rank 0, source} (:func:`~dapo_megatron.handoff.stage_routes.stage_broadcast_groups`)
    one at a time — a header object, one packed byte buffer — and a ``None`` header ends the stage.
    """
    is_source, stage, num_stages = _this_stage_source()
    rank = dist.get_rank()
    if rank == 0 and not (is_source and stage == 0):
        raise RuntimeError("global rank 0 is not TP 0 / DP 0 / PP 0: unexpected megatron rank order")
    stages = stage_broadcast_groups() if num_stages > 1 else None
    buckets = export_hf_buckets(model, spec, bucket_bytes=bucket_bytes, dtype=dtype, tp_gather=tp_gather,
                                mappings=mappings)
    if rank == 0:
        yield from buckets
        device = next(unwrap_model(model).parameters()).device
        for later in range(1, num_stages):
            while (bucket := _receive_bucket(stages.sources[later], stages.group(later), device)) is not None:
                yield bucket
        return
    sending = is_source and stage > 0
    for bucket in buckets:  # non-sources: drain (collectives); sources of later stages: broadcast to rank 0
        if sending:
            _broadcast_bucket(bucket, stages.sources[stage], stages.group(stage))
    if sending:
        _broadcast_bucket(None, stages.sources[stage], stages.group(stage))


def stream_stage_buckets(model: torch.nn.Module, spec: ModelSpec, receiver: StageStreamReceiver, *,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None,
                         tp_gather: TensorParallelGather = PROCESS_GROUP_GATHER) -> str | None:
    """The per-stage route: each stage's source feeds its own buckets to ``receiver.open_stage(stage, stages)``.

    Every rank calls it (the TP gathers); a source whose consumer fails still drains its stage, so its TP partners
    are not left waiting. Returns this rank's error message, None when it had none (the caller shares them).
    """
    is_source, stage, num_stages = _this_stage_source()
    buckets = export_hf_buckets(model, spec, bucket_bytes=bucket_bytes, dtype=dtype, tp_gather=tp_gather)
    error = None
    if is_source:
        try:
            receiver.open_stage(stage, num_stages)(buckets)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
            error = f"stage {stage} (rank {dist.get_rank()}): {type(exc).__name__}: {exc}"
    for _ in buckets:
        pass
    return error
