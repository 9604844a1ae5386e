"""R3, ``algorithm.moe_routing_replay: replay_rollout``: the trainer routes every token to the experts the rollout
engine routed it to.

The engine's routing of one sample (``Sample.routed_experts``, kept on the host as int16) is ``[P + R − 1, L, k]``:
the top-k expert ids of every token of ``prompt ‖ response`` but the last response token (the engine never feeds the
last sampled token through the model), per MoE layer — SGLang's ``meta_info["routed_experts"]`` format
(``sglang/srt/state_capturer/base.py``, ``get_topk``: tokens ``[0, seqlen − 1)``), which the embedded engine records
the same way. A sample without routing (``None``) is routed by the trainer's own routers.

:func:`engine_targets` lays the samples' routing out for THIS rank's packed micro-batches, whatever the backend's
row layout: the row position of every token a response log-prob depends on is known from ``response_index`` (the
logits predicting response token ``t`` sit at the position of sequence token ``P − 1 + t``, and the prompt's tokens
are contiguous before its last one), which holds for the THD layout and the CPU "segments" layout alike. Under
sequence parallelism a TP rank's routers see its contiguous share of the row; a pipeline stage's routers their own
layers (``router.layer_number``). Positions the engine did not route (the last response token, padding, a sample
without routing) are ``-1``.

:func:`replaying_engine_routing` replays those targets in a forward pass through megatron-core's ``RouterReplay``
(REPLAY_FORWARD; :class:`dapo_megatron.policy.moe_routing.RoutingReplay` holds the routers), filling ``-1`` with the
router's own top-k of that pass, and keeps what it replayed as a :class:`RecordedRouting`: π_old's pass runs it, and
every update of the step replays exactly π_old's routing (as R2 does). It also counts, per (token, layer) the engine
routed, whether the router's own top-k on the same hidden states is the engine's set (:class:`RoutingAgreement`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from torch import Tensor

from dapo_megatron.policy.moe_routing import RecordedRouting, RoutingReplay
from dapo_megatron.policy.packing import MicroBatch, PolicySample

UNROUTED = -1  # a position the engine gave no routing for: the router chooses itself


def routing_layout(routing: Tensor | None, *, prompt_length: int, response_length: int, layers: int, topk: int,
                   where: str) -> Tensor | None:
    """``routing`` checked against its sample: ``[P + R − 1, L, k]`` int16 (the engine may also include the last
    token: one more row, dropped). Raises ValueError naming ``where``."""
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
    """Flat row positions of sequence tokens ``0 … P + R − 2`` of the micro-batch's ``row``-th sample."""
    predictors = mb.response_index[row, :response_length].cpu()
    first = int(predictors[0]) - (prompt_length - 1)
    return torch.cat([torch.arange(first, first + prompt_length - 1), predictors])


def engine_targets(micro_batches: Sequence[MicroBatch], samples: Sequence[PolicySample],
                   routing: Sequence[Tensor | None], *, layers: Sequence[int], topk: int, split: int = 1,
                   part: int = 0) -> RecordedRouting:
    """Per router (``layers``: this stage's, 0-based global layer numbers) and micro-batch, the ``[S / split, k]``
    int16 expert ids of the micro-batch's row share ``part`` (sequence parallelism: the TP rank), ``UNROUTED`` where
    the engine gave none."""
    per_router: list[list[Tensor]] = [[] for _ in layers]
    layer_index = torch.tensor(list(layers), dtype=torch.long)
    for mb in micro_batches:
        if mb.tokens.shape[0] != 1:
            raise ValueError(f"rollout routing replay needs one packed row per micro-batch, got {mb.tokens.shape[0]}")
        length = mb.tokens.shape[1]
        if length % split:
            raise ValueError(f"a row of {length} tokens does not split over {split} sequence-parallel ranks")
        row = torch.full((length, len(layers), topk), UNROUTED, dtype=torch.int16)
        for position, index in enumerate(mb.sample_indices):
            if routing[index] is None:
                continue
            sample = samples[index]
            row[sequence_positions(mb, position, sample.prompt_length, sample.response_length)] = \
                routing[index][:, layer_index]
        share = length // split
        for r in range(len(layers)):
            per_router[r].append(row[part * share:(part + 1) * share, r].contiguous())
    return RecordedRouting(per_router)


def stage_targets(routers, micro_batches: Sequence[MicroBatch], samples: Sequence[PolicySample],
                  routing: Sequence[Tensor | None], *, sequence_parallel: bool) -> RecordedRouting:
    """:func:`engine_targets` for this rank: its stage's ``routers`` and, under sequence parallelism, its TP share."""
    if len(routing) != len(samples):
        raise ValueError(f"engine routing for {len(routing)} samples, {len(samples)} samples")
    split = parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    return engine_targets(micro_batches, samples, routing, layers=[router.layer_number - 1 for router in routers],
                          topk=routers[0].topk, split=split,
                          part=parallel_state.get_tensor_model_parallel_rank() if split > 1 else 0)


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


@contextmanager
def replaying_engine_routing(replay: RoutingReplay, targets: RecordedRouting
                             ) -> Iterator[tuple[RecordedRouting, RoutingAgreement]]:
    """The forwards in the block route with ``targets`` (micro-batch by micro-batch, the router's own top-k where
    ``UNROUTED``); yields what was replayed (for the updates) and the agreement counts, filled as the block runs."""
    routers = replay.routers
    if len(targets.per_router) != len(routers):
        raise ValueError(f"engine routing for {len(targets.per_router)} routers, the stage has {len(routers)}")
    queues = [list(reversed(indices)) for indices in targets.per_router]
    replayed = RecordedRouting([[] for _ in routers])
    agreement = RoutingAgreement()

    def target(index: int):
        def hook(router, args) -> None:
            hidden = args[0].reshape(-1, args[0].shape[-1])
            if not queues[index]:
                raise RuntimeError(f"rollout routing replay: router {index} ran more forwards than were laid out")
            wanted = queues[index].pop()
            if wanted.shape[0] != hidden.shape[0]:
                raise RuntimeError(f"rollout routing replay: router {index} routes {hidden.shape[0]} tokens, the "
                                   f"layout has {wanted.shape[0]}")
            with torch.no_grad():
                own = own_topk(router, hidden)
            wanted = wanted.to(device=own.device, dtype=torch.long)
            routed = wanted[:, 0] != UNROUTED
            same = (torch.sort(own, dim=-1).values == torch.sort(wanted, dim=-1).values).all(-1)
            agreement.decisions += int(routed.sum())
            agreement.agreed += int((same & routed).sum())
            used = torch.where(routed[:, None], wanted, own)
            replayed.per_router[index].append(used.to(device="cpu", dtype=torch.int16))
            router.router_replay.set_target_indices(used)
        return hook

    with replay._action(RouterReplayAction.REPLAY_FORWARD, [r.register_forward_pre_hook(target(i))
                                                             for i, r in enumerate(routers)]):
        yield replayed, agreement
    left = [len(queue) for queue in queues if queue]
    if left:
        raise RuntimeError(f"rollout routing replay: {left[0]} laid-out micro-batches were not run")


@contextmanager
def replaying_on_stage(replay: RoutingReplay, micro_batches: Sequence[MicroBatch], samples: Sequence[PolicySample],
                       routing: Sequence[Tensor | None], device: torch.device
                       ) -> Iterator[tuple[RecordedRouting, RoutingAgreement]]:
    """:func:`replaying_engine_routing` of this rank's :func:`stage_targets`; the agreement, once the block ran, is
    summed over the ranks (a collective: every rank runs the block)."""
    sequence_parallel = replay.routers[0].config.sequence_parallel
    targets = stage_targets(replay.routers, micro_batches, samples, routing, sequence_parallel=sequence_parallel)
    with replaying_engine_routing(replay, targets) as (replayed, agreement):
        yield replayed, agreement
    total = summed_agreement(agreement, device, sequence_parallel=sequence_parallel)
    agreement.decisions, agreement.agreed = total.decisions, total.agreed


def summed_agreement(agreement: RoutingAgreement, device: torch.device, *, sequence_parallel: bool) -> RoutingAgreement:
    """The counts over every rank that routed distinct (token, layer) pairs: DP (and EP) ranks hold other tokens,
    TP ranks under sequence parallelism other parts of the row, pipeline stages other layers."""
    counts = torch.tensor([agreement.decisions, agreement.agreed], dtype=torch.float64, device=device)
    groups = [parallel_state.get_data_parallel_group()]
    if sequence_parallel:
        groups.append(parallel_state.get_tensor_model_parallel_group())
    groups.append(parallel_state.get_pipeline_model_parallel_group())
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
    return RoutingAgreement(int(counts[0]), int(counts[1]))


def rollout_routing_bytes(*, tokens: int, layers: int, topk: int) -> int:
    """Host bytes of one sample's engine routing (int16)."""
    return tokens * layers * topk * 2
