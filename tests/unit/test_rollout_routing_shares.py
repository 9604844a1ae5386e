"""Issue 40, items 2 and 7, on the host: the engine's routing (R3) stays on rank 0 and each rank receives exactly its
own rows — its DP share's samples, its sequence-parallel part of each row, its pipeline stage's layers — and the
replay's per-micro-batch work leaves the agreement counts on the device (policy/rollout_routing.py,
collectors/batch.py). The exchange itself between ranks runs in tests/integration/test_rollout_routing_replay.py."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dapo_megatron.collectors.batch import hand_over_rollouts, pack_rollout_batch, routing_kept_back, \
    unpack_rollout_batch
from dapo_megatron.collectors.group import RolloutGroup
from dapo_megatron.policy.batch_plan import PackedBatching, plan_data_parallel
from dapo_megatron.policy.packing import PolicySample, ThdPacker
from dapo_megatron.policy.rollout_routing import (
    UNROUTED,
    answer_request,
    engine_targets,
    placed_targets,
    replaying_engine_routing,
    routing_layout,
    routing_request,
)

LAYERS, TOPK = 3, 2


def groups() -> list[RolloutGroup]:
    generator = torch.Generator().manual_seed(0)
    made = []
    for g in range(4):
        prompt = torch.randint(1, 90, (3 + g,), generator=generator).tolist()
        responses = [torch.randint(1, 90, (2 + 3 * j + g,), generator=generator).tolist() for j in range(2)]
        made.append(RolloutGroup(
            prompt_ids=prompt, ground_truth="1", data_source="t", weight_version=0, responses=responses,
            engine_logprobs=[[-1.0] * len(r) for r in responses], finish_reasons=["stop"] * 2, accs=[True, False],
            scores=[1.0, -1.0], overlong_penalties=[0.0] * 2,
            routed_experts=[torch.randint(0, 6, (len(prompt) + len(r) - 1, LAYERS, TOPK), dtype=torch.int16,
                                          generator=generator) if (g, j) != (2, 1) else None
                            for j, r in enumerate(responses)]))
    return made


def test_the_batch_carries_only_the_routings_shape_and_rank_0_keeps_its_values():
    sent = groups()
    packed = pack_rollout_batch(sent, {})
    kept = routing_kept_back(packed)
    assert set(kept) == {"routed_experts"} and "routed_experts" not in packed.tensors  # what crosses: lengths only
    crossing = sum(t.numel() * t.element_size() for t in packed.tensors.values())
    assert crossing < kept["routed_experts"].numel()  # the values are most of the batch's bytes
    elsewhere, _ = unpack_rollout_batch(packed)  # another rank's copy
    for before, after in zip(sent, elsewhere):
        for a, b in zip(before.routed_experts, after.routed_experts):
            assert (a is None) == (b is None)
            if a is not None:
                assert b.device.type == "meta" and b.shape == a.shape and b.dtype == torch.int16
                routing_layout(b, prompt_length=len(after.prompt_ids), response_length=a.shape[0] - len(
                    after.prompt_ids) + 1, layers=LAYERS, topk=TOPK, where="x")  # checked without its values
    on_rank0, _ = hand_over_rollouts(lambda: (sent, {}), what="test")  # one process: rank 0, the values
    assert all(torch.equal(a, b) for g, h in zip(sent, on_rank0) for a, b in zip(g.routed_experts, h.routed_experts)
               if a is not None)


def policy_samples(made: list[RolloutGroup]) -> tuple[list[PolicySample], list]:
    samples = [PolicySample(prompt_ids=torch.tensor(g.prompt_ids), response_ids=torch.tensor(r))
               for g in made for r in g.responses]
    return samples, [r for g in made for r in g.routed_experts]


def test_each_rank_asks_for_its_dp_share_its_sequence_parallel_part_and_its_stages_layers():
    samples, routing = policy_samples(groups())
    routed = [r is not None for r in routing]
    asked, total_rows = set(), 0
    for dp_rank in range(2):
        plan = plan_data_parallel(samples, PackedBatching(token_budget=24, pad_to_multiple=2), ThdPacker(),
                                  data_parallel=2, data_parallel_rank=dp_rank, vocab_size=100)
        for layers in ([0, 1], [2]):  # two pipeline stages
            for part in range(2):  # two sequence-parallel (TP) ranks
                request = routing_request(plan.micro_batches, samples, routed, layers=layers, split=2, part=part)
                rows = answer_request(request, routing)
                assert rows.shape == (request.tokens, len(layers), TOPK)
                total_rows += rows.numel()
                for index, runs in request.entries:
                    for start, end in runs:
                        for token in range(start, end):
                            key = (index, token, tuple(layers))
                            assert key not in asked  # no row is sent to two ranks
                            asked.add(key)
                # laid out, the rank's targets are the whole row's targets cut to its part
                whole = engine_targets(plan.micro_batches, samples, routing, layers=layers, topk=TOPK, split=2,
                                       part=part)
                mine = placed_targets(request, rows, plan.micro_batches, topk=TOPK, split=2)
                assert all(torch.equal(a, b) for r in range(len(layers))
                           for a, b in zip(mine.per_router[r], whole.per_router[r]))
    every = {(i, t, stage) for i, r in enumerate(routing) if r is not None for t in range(r.shape[0])
             for stage in ((0, 1), (2,))}
    assert asked == every  # every routed (token, stage) is asked for exactly once, over all ranks
    assert total_rows == sum(r.numel() for r in routing if r is not None)  # the step's routing, once in all


class HostReads(TorchFunctionMode):
    """Counts what reads a tensor's value into Python (on a GPU: a blocking copy back)."""

    READS = {torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.item,
             torch.Tensor.tolist}

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += func in self.READS
        return func(*args, **(kwargs or {}))


class Router(torch.nn.Linear):
    """What the replay reads of a megatron router: its weight and top-k."""

    def __init__(self, hidden: int, experts: int, topk: int) -> None:
        super().__init__(hidden, experts, bias=False)
        self.topk = topk


def test_the_replay_reads_nothing_back_per_micro_batch_and_counts_agreement_on_the_device():
    torch.manual_seed(0)
    routers = [Router(8, 6, TOPK) for _ in range(2)]
    hidden = [torch.randn(5, 8), torch.randn(3, 8)]  # two micro-batches
    targets = [[torch.full((len(h), TOPK), UNROUTED, dtype=torch.int16) for h in hidden] for _ in routers]
    for per_router, router in zip(targets, routers):
        per_router[0][:2] = torch.topk(router(hidden[0][:2]), TOPK).indices.to(torch.int16)  # agrees
        per_router[1][:] = torch.tensor([[4, 5]] * 3, dtype=torch.int16)  # what the router itself would not pick
    seam = SimpleNamespace(routers=routers, choose=None)

    @contextmanager
    def routed_by(choose):
        seam.choose = choose
        yield

    seam.routed_by = routed_by
    reads = HostReads()
    with replaying_engine_routing(seam, SimpleNamespace(per_router=targets)) as replayed:
        with reads:
            for m, h in enumerate(hidden):
                for index, router in enumerate(routers):
                    used = seam.choose(index, router, h)
                    assert used.dtype == torch.long
    assert reads.reads == 0  # issue 40.7: no int(...) per router and micro-batch
    assert isinstance(replayed.counts, torch.Tensor)
    agreement = replayed.agreement()  # read once, after the pass
    assert agreement.decisions == 2 * (2 + 3)
    own = [torch.topk(r(hidden[1]), TOPK).indices.sort(-1).values for r in routers]
    flipped = sum(int((o != torch.tensor([4, 5])).any(-1).sum()) for o in own)
    assert agreement.agreed == 2 * 2 + (2 * 3 - flipped)
    assert [len(per_router) for per_router in replayed.routing.per_router] == [2, 2]


def test_a_router_asked_for_more_forwards_than_laid_out_is_an_error():
    routers = [Router(8, 6, TOPK)]
    seam = SimpleNamespace(routers=routers)

    @contextmanager
    def routed_by(choose):
        seam.choose = choose
        yield

    seam.routed_by = routed_by
    with pytest.raises(RuntimeError, match="1 laid out micro-batches were not run"):
        with replaying_engine_routing(seam, SimpleNamespace(per_router=[[torch.zeros(2, TOPK, dtype=torch.int16)]])):
            pass
