"""R3's host side: the engine's routing checked per sample, laid out for packed rows (the THD layout and the CPU
"segments" layout, sequence-parallel shares), carried through the rollout batch, and the config's refusals."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.collectors.batch import pack_rollout_batch, unpack_rollout_batch
from dapo_megatron.collectors.group import RolloutGroup
from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.cpu.segment_packing import SegmentPacker
from dapo_megatron.policy.packing import PolicySample, ThdPacker, pack_micro_batches
from dapo_megatron.policy.rollout_routing import UNROUTED, engine_targets, routing_layout

LAYERS, TOPK = 3, 2


def token_routing(sample: PolicySample) -> torch.Tensor:
    """A routing that names its token: position p of layer l routes to ``token(p) + 1000 l`` (and + 1)."""
    ids = torch.cat([sample.prompt_ids, sample.response_ids])[:-1]
    layer = 1000 * torch.arange(LAYERS)
    first = ids[:, None] + layer[None, :]
    return torch.stack([first, first + 1], dim=-1).to(torch.int16)


def samples_sharing_prompts() -> list[PolicySample]:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 500, (n,), generator=generator) for n in (4, 7)]
    return [PolicySample(prompt_ids=prompts[i % 2], response_ids=torch.randint(1, 500, (2 + 3 * i,),
                                                                               generator=generator))
            for i in range(5)]


@pytest.mark.parametrize("packer", [ThdPacker(), SegmentPacker()], ids=["thd", "segments"])
def test_every_routed_row_position_gets_its_own_tokens_routing(packer):
    samples = samples_sharing_prompts()
    routing = [token_routing(s) for s in samples]
    routing[3] = None  # a sample the engine gave no routing: its positions route by themselves
    micro_batches = pack_micro_batches(samples, packer, token_budget=40, pad_to_multiple=4)
    targets = engine_targets(micro_batches, samples, routing, layers=range(LAYERS), topk=TOPK)
    routed = unrouted = 0
    for m, mb in enumerate(micro_batches):
        tokens = mb.tokens[0]
        for layer in range(LAYERS):
            target = targets.per_router[layer][m]
            assert target.shape == (len(tokens), TOPK) and target.dtype == torch.int16
            known = target[:, 0] != UNROUTED
            assert torch.equal(target[known, 0], (tokens[known] + 1000 * layer).to(torch.int16))
            assert torch.equal(target[known, 1], target[known, 0] + 1)
            routed, unrouted = routed + int(known.sum()), unrouted + int((~known).sum())
    # control: sample 3's tokens (and, in THD rows, each response's last token and the padding) stay unrouted
    assert routed > 0 and unrouted >= LAYERS * (samples[3].response_length - 1)


def test_a_sequence_parallel_rank_gets_its_contiguous_share_of_the_row():
    samples = samples_sharing_prompts()
    routing = [token_routing(s) for s in samples]
    micro_batches = pack_micro_batches(samples, ThdPacker(), token_budget=40, pad_to_multiple=2)
    whole = engine_targets(micro_batches, samples, routing, layers=[2, 0], topk=TOPK)
    parts = [engine_targets(micro_batches, samples, routing, layers=[2, 0], topk=TOPK, split=2, part=p)
             for p in range(2)]
    for r in range(2):
        for m in range(len(micro_batches)):
            assert torch.equal(torch.cat([parts[0].per_router[r][m], parts[1].per_router[r][m]]),
                               whole.per_router[r][m])
    assert whole.per_router[0][0][0, 0] == micro_batches[0].tokens[0, 0] + 2000  # router 0 is layer 2


def test_routing_is_checked_against_its_sample():
    routing = torch.arange(6 * LAYERS * TOPK, dtype=torch.int16).reshape(6, LAYERS, TOPK)
    assert torch.equal(routing_layout(routing, prompt_length=3, response_length=4, layers=LAYERS, topk=TOPK,
                                      where="x"), routing)
    with_last = torch.cat([routing, routing[:1]])  # an engine that also routed the last token: dropped
    assert torch.equal(routing_layout(with_last, prompt_length=3, response_length=4, layers=LAYERS, topk=TOPK,
                                      where="x"), routing)
    with pytest.raises(ValueError, match=r"response 1 of group 0: routed experts of shape \(6, 3, 2\), expected "
                                         r"\[8, 3, 2\]"):
        routing_layout(routing, prompt_length=5, response_length=4, layers=LAYERS, topk=TOPK,
                       where="response 1 of group 0")
    assert routing_layout(None, prompt_length=5, response_length=4, layers=LAYERS, topk=TOPK, where="x") is None


def group(routed: bool) -> RolloutGroup:
    responses = [[7, 8, 9], [3, 4]]
    routing = [torch.randint(0, 6, (3 + len(r) - 1, LAYERS, TOPK), dtype=torch.int16) for r in responses]
    return RolloutGroup(prompt_ids=[5, 6, 7], ground_truth="1", data_source="t", responses=responses,
                        engine_logprobs=[[-1.0] * 3, [-1.0] * 2], finish_reasons=["stop"] * 2, accs=[True, False],
                        scores=[1.0, -1.0], overlong_penalties=[0.0] * 2, weight_version=0,
                        routed_experts=routing if routed else None)


def test_the_rollout_batch_carries_each_responses_routing_as_bytes():
    groups = [group(True), group(False), group(True)]
    packed = pack_rollout_batch(groups, {})
    assert packed.tensors["routed_experts"].dtype == torch.uint8  # gloo broadcasts no int16
    unpacked, _ = unpack_rollout_batch(packed)
    assert unpacked[1].routed_experts is None
    for sent, received in zip(groups, unpacked):
        for a, b in zip(sent.routed_experts or [], received.routed_experts or []):
            assert b.dtype == torch.int16 and torch.equal(a, b)
    assert "routed_experts" not in pack_rollout_batch([group(False)], {}).tensors  # control: nothing when none


MINIMAL = ["model.source=tiny", "model.tiny.arch=qwen3_moe", "data.source=synthetic", "rollout.engine=embedded",
           "algorithm.moe_routing_replay=replay_rollout"]


@pytest.mark.parametrize("override, message", [
    ("model.tiny.arch=qwen3", "replay_rollout needs a mixture-of-experts model"),
    ("rollout.engine=sglang", "add --enable-return-routed-experts"),
    ("rollout.mode=async", "cannot replay a partial rollout"),
    ("rollout.tools.enabled=true", "does not follow multi-turn tool rollouts"),
])
def test_r3_refusals_name_the_key_and_the_reason(override, message):
    with pytest.raises(ConfigError, match=f"algorithm.moe_routing_replay: .*{message}"):
        load_config(None, MINIMAL + [override])
    load_config(None, MINIMAL)  # control: the embedded engine, sync mode
    load_config(None, MINIMAL + ["rollout.mode=async", "rollout.partial_rollouts=false"])  # whole responses: fine


def test_a_step_without_any_engine_routing_is_refused_not_silently_routed_by_the_trainer():
    from dapo_megatron.trainer.policy_update import PolicyUpdate

    config = load_config(None, MINIMAL + ["trainer.train_batch_size=2", "trainer.mini_batch_size=1",
                                          "rollout.n_samples=2"])
    stage = PolicyUpdate(None, config)  # the check reads the groups only; the actor is used past it
    with pytest.raises(ValueError, match="the rollout engine returned no routing for any response of the step"):
        stage.engine_routing([group(False), group(False)])
