"""R3, ``algorithm.moe_routing_replay: replay_rollout``: the trainer routes every token to the experts the rollout
engine routed it to.

The engine's routing of one sample (``Sample.routed_experts``, kept on the host as int16) is ``[P + R − 1, L, k]``:
the top-k expert ids of every token of ``prompt ‖ response`` but the last response token (the engine never feeds the
last sampled token through the model), per MoE layer — SGLang's ``meta_info["routed_experts"]`` format
(``sglang/srt/state_capturer/base.py``, ``get_topk``: tokens ``[0, seqlen − 1)``), which the embedded engine records
the same way. A sample without routing (``None``) is routed by the trainer's own routers.

Only global rank 0 holds the engine's routing of a step (it collected it; the rollout batch carries only its shapes
to the other ranks, :mod:`dapo_megatron.collectors.batch`). For each forward pass every rank asks rank 0 for exactly
the rows it routes (:class:`RoutingRequest`): the tokens of its DP share's micro-batches, within its sequence-parallel
part of each row, for its pipeline stage's layers; rank 0 answers every rank in turn (:func:`rows_from_rank0`). A
rank thus receives its own share, never the step's whole routing.

The row position of every token a response log-prob depends on is known from ``response_index`` (the logits
predicting response token ``t`` sit at the position of sequence token ``P − 1 + t``, and the prompt's tokens are
contiguous before its last one), which holds for the THD layout and the CPU "segments" layout alike (where samples of
one prompt share its positions, the last of them in the row routes them). Under sequence parallelism a TP rank's
routers see its contiguous share of the row; a pipeline stage's routers their own layers (``router.layer_number``).
Positions the engine did not route (the last response token, padding, a sample without routing) are ``-1``.

:func:`replaying_engine_routing` replays those targets in a forward pass through
:meth:`dapo_megatron.policy.moe_routing.RoutingReplay.routed_by` (megatron's REPLAY_FORWARD), filling ``-1`` with
the router's own top-k of that pass, and keeps what it replayed as a :class:`RecordedRouting`: π_old's pass runs it,
and every update of the step replays exactly π_old's routing (as R2 does). It also counts, on the device, per (token,
layer) the engine routed, whether the router's own top-k on the same hidden states is the engine's set
(:class:`RoutingAgreement`); the counts are read once, after the pass.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from dapo_megatron.policy.moe_routing import MicroBatchQueues, RecordedRouting, RoutingReplay, host_copy, on_device
from dapo_megatron.policy.packing import MicroBatch, PolicySample
from dapo_megatron.rank_zero import waiting_group

UNROUTED = -1  # a position the engine gave no routing for: the router chooses itself


def routing_layout(routing: Tensor | None, *, prompt_length: int, response_length: int, layers: int, topk: int,
                   where: str) -> Tensor | None:
    """``routing`` checked against its sample: ``[P + R − 1, L, k]`` int16 (the engine may also include the last
    token: one more row, dropped). Raises ValueError naming ``where``. A rank other than 0 holds only the shape (a
    tensor on the ``meta`` device), which is checked the same."""
    if routing is None:
        return None
    routing = torch.as_tensor(routing)
    expected = prompt_length + response_length - 1
    if routing.dim() != 3 or tuple(routing.shape[1:]) != (layers, topk) or routing.shape[0] not in (expected,
                                                                                                   expected + 1):
        raise ValueError(f"{where}: routed experts of shape {tuple(routing.shape)}, expected [{expected}, {layers}, "
                         f"{topk}] for {prompt_length} prompt and {response_length} response tokens")
    return routing[:expected].to(torch.int16)


def sequence_positions(mb: MicroBatch, row: int, prompt_length: int, response_length: int) -> Tensor:
    """Flat row positions of sequence tokens ``0 … P + R − 2`` of the micro-batch's ``row``-th sample (``mb`` on the
    host)."""
    predictors = mb.response_index[row, :response_length]
    first = int(predictors[0]) - (prompt_length - 1)
    return torch.cat([torch.arange(first, first + prompt_length - 1), predictors])


@dataclass
class RoutingRequest:
    """The engine routing one rank needs for one pass: for each entry ``(sample, runs)`` the rows of the sample's
    tokens ``[start, end)`` of each run, at the rank's ``layers`` (0-based global layer numbers). What is sent to
    rank 0; ``placements`` (where each entry's rows go: micro-batch number, positions in the rank's part of its row)
    stays with the rank."""

    layers: list[int]
    entries: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)
    placements: list[tuple[int, Tensor]] = field(default_factory=list, repr=False)

    @property
    def tokens(self) -> int:
        return sum(end - start for _, runs in self.entries for start, end in runs)

    def for_rank0(self) -> "RoutingRequest":
        return RoutingRequest(self.layers, self.entries)


def _runs(indices: Tensor) -> list[tuple[int, int]]:
    """Sorted token indices as ``[start, end)`` runs of consecutive ones."""
    values = indices.tolist()
    runs, start = [], values[0]
    for previous, value in zip(values, values[1:]):
        if value != previous + 1:
            runs.append((start, previous + 1))
            start = value
    runs.append((start, values[-1] + 1))
    return runs


def routing_request(micro_batches: Sequence[MicroBatch], samples: Sequence[PolicySample], routed: Sequence[bool], *,
                    layers: Sequence[int], split: int = 1, part: int = 0) -> RoutingRequest:
    """What this rank asks for: the routed samples' tokens that land in its ``part`` of ``split`` of each of its
    (host) micro-batches' rows."""
    request = RoutingRequest(list(layers))
    for number, mb in enumerate(micro_batches):
        if mb.tokens.shape[0] != 1:
            raise ValueError(f"rollout routing replay needs one packed row per micro-batch, got {mb.tokens.shape[0]}")
        length = mb.tokens.shape[1]
        if length % split:
            raise ValueError(f"a row of {length} tokens does not split over {split} sequence-parallel ranks")
        owner = torch.full((length,), -1, dtype=torch.long)  # which row sample routes each position (the last one)
        token = torch.full((length,), -1, dtype=torch.long)
        for row, index in enumerate(mb.sample_indices):
            if routed[index]:
                sample = samples[index]
                positions = sequence_positions(mb, row, sample.prompt_length, sample.response_length)
                owner[positions], token[positions] = index, torch.arange(len(positions))
        share = length // split
        start = part * share
        owner, token = owner[start:start + share], token[start:start + share]
        for index in owner[owner >= 0].unique().tolist():
            mine = (owner == index).nonzero().reshape(-1)
            order = token[mine].argsort()
            request.entries.append((index, _runs(token[mine][order])))
            request.placements.append((number, mine[order]))
    return request


def answer_request(request: RoutingRequest, routing: Sequence[Tensor | None]) -> Tensor:
    """Rank 0's answer: int16 ``[request.tokens, len(layers), k]``, the entries' rows in order."""
    layers = torch.tensor(request.layers, dtype=torch.long)
    rows = [routing[index][start:end][:, layers] for index, runs in request.entries for start, end in runs]
    if not rows:
        topk = next((r.shape[-1] for r in routing if r is not None), 1)
        return torch.empty(0, len(request.layers), topk, dtype=torch.int16)
    return torch.cat(rows).to(torch.int16)


def rows_from_rank0(request: RoutingRequest, answer: Callable[[RoutingRequest], Tensor], *, topk: int) -> Tensor:
    """Every rank calls this (a collective on :func:`~dapo_megatron.rank_zero.waiting_group`): rank 0 gathers the
    requests and sends each rank its answer, computed by ``answer`` there; returns this rank's rows."""
    group = waiting_group()
    if group is None:
        return answer(request)
    rank, world = dist.get_rank(), dist.get_world_size()
    requests: list | None = [None] * world if rank == 0 else None
    dist.gather_object(request.for_rank0(), requests, dst=0, group=group)
    if rank == 0:
        for other in range(1, world):
            rows = answer(requests[other]).contiguous()
            if rows.numel():
                dist.send(rows.view(torch.uint8).reshape(-1), dst=other, group=group)  # gloo sends no int16
        return answer(request)
    rows = torch.empty(request.tokens, len(request.layers), topk, dtype=torch.int16)
    if rows.numel():
        dist.recv(rows.view(torch.uint8).reshape(-1), src=0, group=group)
    return rows


def placed_targets(request: RoutingRequest, rows: Tensor, micro_batches: Sequence[MicroBatch], *, topk: int,
                   split: int = 1) -> RecordedRouting:
    """Per router and micro-batch the ``[S / split, k]`` int16 expert ids of the rank's part of the row: ``rows``
    where the request placed them, ``UNROUTED`` elsewhere."""
    parts = [torch.full((mb.tokens.shape[1] // split, len(request.layers), topk), UNROUTED, dtype=torch.int16)
             for mb in micro_batches]
    offset = 0
    for number, positions in request.placements:
        parts[number][positions] = rows[offset:offset + len(positions)]
        offset += len(positions)
    return RecordedRouting([[part[:, r].contiguous() for part in parts] for r in range(len(request.layers))])


def engine_targets(micro_batches: Sequence[MicroBatch], samples: Sequence[PolicySample],
                   routing: Sequence[Tensor | None], *, layers: Sequence[int], topk: int, split: int = 1,
                   part: int = 0) -> RecordedRouting:
    """In one process: per router (``layers``: 0-based global layer numbers) and micro-batch, the ``[S / split, k]``
    int16 expert ids of the micro-batch's row part ``part`` (sequence parallelism: the TP rank), ``UNROUTED``
    where the engine gave none."""
    request = routing_request(micro_batches, samples, [r is not None for r in routing], layers=layers, split=split,
                              part=part)
    return placed_targets(request, answer_request(request, routing), micro_batches, topk=topk, split=split)


def stage_targets(routers, micro_batches: Sequence[MicroBatch], samples: Sequence[PolicySample],
                  routing: Sequence[Tensor | None], *, sequence_parallel: bool) -> RecordedRouting:
    """This rank's targets (a collective): its stage's ``routers``, under sequence parallelism its TP part, its DP
    share's host ``micro_batches``; the rows come from rank 0, the one rank holding ``routing``'s values."""
    if len(routing) != len(samples):
        raise ValueError(f"engine routing for {len(routing)} samples, {len(samples)} samples")
    split = parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    part = parallel_state.get_tensor_model_parallel_rank() if split > 1 else 0
    topk = routers[0].topk
    request = routing_request(micro_batches, samples, [r is not None for r in routing],
                              layers=[router.layer_number - 1 for router in routers], split=split, part=part)
    rows = rows_from_rank0(request, lambda asked: answer_request(asked, routing), topk=topk)
    return placed_targets(request, rows, micro_batches, topk=topk, split=split)


@dataclass
class RoutingAgreement:
    """(token, layer) decisions the engine made in a pass, and how many of them the router's own top-k matched."""

    decisions: int = 0
    agreed: int = 0

    def fraction(self) -> float:
        return self.agreed / self.decisions if self.decisions else float("nan")


def own_topk(router, hidden: Tensor) -> Tensor:
    """The router's own top-k expert ids ``[T, k]`` for ``hidden [T, H]``: top-k of its fp32 logits, the set
    megatron's softmax top-k picks for a router without expert bias or expert groups (Qwen3-MoE's)."""
    logits = torch.nn.functional.linear(hidden.float(), router.weight.float())
    return torch.topk(logits, router.topk, dim=-1).indices


@dataclass
class ReplayedPass:
    """What a replayed pass leaves: the routing it used (for the updates) and, on the device until the pass ends,
    the agreement counts ``[decisions, agreed]`` (:attr:`counts`, None before the first forward)."""

    routing: RecordedRouting
    counts: Tensor | None = None

    def agreement(self) -> RoutingAgreement:
        if self.counts is None:
            return RoutingAgreement()
        decisions, agreed = self.counts.tolist()
        return RoutingAgreement(int(decisions), int(agreed))


@contextmanager
def replaying_engine_routing(replay: RoutingReplay, targets: RecordedRouting) -> Iterator[ReplayedPass]:
    """The forwards in the block route with ``targets`` (micro-batch by micro-batch, the router's own top-k where
    ``UNROUTED``); yields what was replayed and the agreement counts, filled as the block runs."""
    routers = replay.routers
    if len(targets.per_router) != len(routers):
        raise ValueError(f"engine routing for {len(targets.per_router)} routers, the stage has {len(routers)}")
    on_gpu = next(routers[0].parameters()).is_cuda
    queues = MicroBatchQueues([[t.pin_memory() if on_gpu else t for t in indices] for indices in targets.per_router],
                              what="laid out")
    replayed = ReplayedPass(RecordedRouting([[] for _ in routers]))

    def choose(index: int, router, hidden: Tensor) -> Tensor:
        wanted = queues.take(index, hidden.shape[0])
        with torch.no_grad():
            own = own_topk(router, hidden)
            wanted = on_device(wanted, own.device)
            routed = wanted[:, 0] != UNROUTED
            same = (torch.sort(own, dim=-1).values == torch.sort(wanted, dim=-1).values).all(-1)
            counts = torch.stack([routed.sum(), (same & routed).sum()])
            replayed.counts = counts if replayed.counts is None else replayed.counts + counts
            used = torch.where(routed[:, None], wanted, own)
        replayed.routing.per_router[index].append(host_copy(used))
        return used

    with replay.routed_by(choose):
        yield replayed
    queues.require_all_taken()


@contextmanager
def replaying_on_stage(replay: RoutingReplay, micro_batches: Sequence[MicroBatch], samples: Sequence[PolicySample],
                       routing: Sequence[Tensor | None], device: torch.device
                       ) -> Iterator[tuple[RecordedRouting, RoutingAgreement]]:
    """:func:`replaying_engine_routing` of this rank's :func:`stage_targets` (``micro_batches`` on the host); the
    agreement, once the block ran, is summed over the ranks (collectives: every rank runs the block)."""
    sequence_parallel = replay.routers[0].config.sequence_parallel
    targets = stage_targets(replay.routers, micro_batches, samples, routing, sequence_parallel=sequence_parallel)
    agreement = RoutingAgreement()
    with replaying_engine_routing(replay, targets) as replayed:
        yield replayed.routing, agreement
    counts = replayed.counts if replayed.counts is not None else torch.zeros(2, dtype=torch.long, device=device)
    total = summed_agreement(counts.to(device=device, dtype=torch.float64), sequence_parallel=sequence_parallel)
    agreement.decisions, agreement.agreed = total.decisions, total.agreed


def summed_agreement(counts: Tensor, *, sequence_parallel: bool) -> RoutingAgreement:
    """``counts`` (``[decisions, agreed]`` on the training device) summed over every rank that routed distinct
    (token, layer) pairs: DP (and EP) ranks hold other tokens, TP ranks under sequence parallelism other parts of the
    row, pipeline stages other layers; read once."""
    groups = [parallel_state.get_data_parallel_group()]
    if sequence_parallel:
        groups.append(parallel_state.get_tensor_model_parallel_group())
    groups.append(parallel_state.get_pipeline_model_parallel_group())
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
    decisions, agreed = counts.tolist()
    return RoutingAgreement(int(decisions), int(agreed))


def rollout_routing_bytes(*, tokens: int, layers: int, topk: int) -> int:
    """Host bytes of one sample's engine routing (int16)."""
    return tokens * layers * topk * 2
