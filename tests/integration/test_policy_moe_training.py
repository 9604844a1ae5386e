"""Training a Qwen3-MoE policy: routing replay (algorithm.moe_routing_replay), the routers' load statistics, the
load-balancing loss, and expert parallelism against the same training without it.

Routing replay is checked where it must be exact. The model's routers are built so that expert 0 is never among
any token's top 2 (its router row is zero while experts 1-4 come in ± pairs, so two of them always score > 0); π_old's
forward records that routing; then expert 0's router row is raised so that it wins for many tokens — the routing
drifts, and nothing else changes. The update replaying π_old's routing sees exactly π_old's forward: every importance
ratio is exactly 1. The same update without replay routes tokens to expert 0: the ratio moves (the control).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from actor_harness import actor_settings, build_test_actor, gather_hf_weights, loss_of, random_samples
from spawn_ranks import run_distributed
from tiny_models import save_random_hf_model
from tiny_qwen3 import EVEN_EXPERTS, ODD_EXPERTS, tiny_qwen3_moe_config
from tiny_qwen3 import write_dormant_expert_model as write_dormant_model

from dapo_megatron.config import ModelConfig, MoEConfig, OptimConfig, load_config
from dapo_megatron.policy.moe_routing import moe_routers
from dapo_megatron.trainer.policy_update import PolicyUpdate
from dapo_megatron.collectors.group import RolloutGroup

TINY_MOE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu_moe.yaml"
VOCAB = 101


def write_dormant_expert_model(directory: Path) -> Path:
    return write_dormant_model(directory, num_experts=ODD_EXPERTS, vocab_size=VOCAB)


def moe_settings(replay: str = "replay_old", aux_loss_coeff: float = 0.0, lr: float = 1e-2) -> dict:
    return actor_settings(model=ModelConfig(precision="fp32", moe=MoEConfig(aux_loss_coeff=aux_loss_coeff)),
                          routing_replay=replay == "replay_old",
                          optim=OptimConfig(lr=lr, adam_eps=1e-3, grad_clip=1e6, weight_decay=0.0))


def without_old(samples):
    return [dataclasses.replace(s, old_logprobs=None) for s in samples]


def drift_routing_to_expert_0(actor) -> None:
    """Raise expert 0's router row in every layer so it wins wherever experts 1 and 3 both score > 0."""
    with torch.no_grad():
        for router in moe_routers(actor.model):
            router.weight[0] = 4.0 * (router.weight[1] + router.weight[3])


def replay_job(hf_dir: str) -> dict:
    samples = without_old(random_samples(6, seed=5, vocab_size=VOCAB))
    out = {}
    for replayed in (True, False):
        actor, _ = build_test_actor(hf_dir, 1, 1, moe_settings())
        old = actor.compute_logprobs(samples, record_routing=True)
        chosen = torch.cat([indices.flatten() for per_router in old.routing.per_router for indices in per_router])
        drift_routing_to_expert_0(actor)
        with_old = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(samples, old.logprobs)]
        metrics = actor.train_minibatch(with_old, loss_of(), routing=old.routing if replayed else None)
        out[replayed] = dict(metrics=metrics, experts_chosen=sorted(set(chosen.tolist())),
                             micro_batches=[len(per_router) for per_router in old.routing.per_router])
    out["recompute"] = recomputed_replay(hf_dir, samples)
    # a routing recorded with other batching is refused, naming the mismatch
    actor, _ = build_test_actor(hf_dir, 1, 1, moe_settings())
    old = actor.compute_logprobs(samples[:3], record_routing=True)
    try:
        actor.train_minibatch([dataclasses.replace(s, old_logprobs=torch.zeros(s.response_length)) for s in samples],
                              loss_of(), routing=old.routing)
        out["mismatch"] = None
    except RuntimeError as error:
        out["mismatch"] = str(error)
    return out


def recomputed_replay(hf_dir: str, samples) -> dict:
    """Issue 40, items 3 and 4: the replayed update over several micro-batches, without and with full activation
    recomputation, and what megatron's REPLAY_BACKWARD queue holds after each router forward (and whether that
    forward was a recomputed one)."""
    from dapo_megatron.policy.batch_plan import PackedBatching
    from dapo_megatron.policy.moe_routing import inside_backward

    batching = PackedBatching(token_budget=32)  # several micro-batches
    out = {}
    for recompute in ("none", "full"):
        actor, _ = build_test_actor(hf_dir, 1, 1, moe_settings(), recompute=recompute)
        old = actor.compute_logprobs(samples, record_routing=True, batching=batching)
        drift_routing_to_expert_0(actor)
        queued = []
        router = moe_routers(actor.model)[0]
        router.register_forward_hook(lambda module, args, output: queued.append(
            (len(module.router_replay.replay_backward_list), inside_backward())))
        with_old = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(samples, old.logprobs)]
        metrics = actor.train_minibatch(with_old, loss_of(), batching=batching, routing=old.routing)
        out[recompute] = dict(metrics=metrics, queued=queued, recomputes=actor.model.config.recompute_granularity)
    return out


@pytest.fixture(scope="module")
def dormant_dir(tmp_path_factory):
    return str(write_dormant_expert_model(tmp_path_factory.mktemp("dormant") / "hf"))


def test_replayed_update_has_ratio_exactly_one_where_the_unreplayed_one_does_not(dormant_dir):
    out = run_distributed(replay_job, 1, dormant_dir)[0]
    assert out[True]["experts_chosen"] == [1, 2, 3, 4]  # π_old never routed to expert 0
    assert out[True]["micro_batches"] == [1, 1]  # one micro-batch, two MoE layers
    replayed, unreplayed = out[True]["metrics"], out[False]["metrics"]
    assert replayed["ratio_mean"] == 1.0 and replayed["approx_kl"] == 0.0
    assert replayed["clipfrac_high"] == replayed["clipfrac_low"] == 0.0
    assert abs(unreplayed["ratio_mean"] - 1.0) > 1e-3 and unreplayed["approx_kl"] > 0.0  # control
    assert out["mismatch"] is not None and "different batching" in out["mismatch"]
    plain, full = out["recompute"]["none"], out["recompute"]["full"]
    assert full["recomputes"] == "full" and plain["recomputes"] is None
    micro_batches = len(plain["queued"])
    assert micro_batches >= 3 and not any(recomputed for _, recomputed in plain["queued"])
    # without recomputation megatron's REPLAY_BACKWARD queue stays empty (it grew by one per micro-batch: 1, 2, 3 ...)
    assert [queued for queued, _ in plain["queued"]] == [0] * micro_batches
    # with it, each micro-batch's target waits for its recomputed forward, which takes it (and consumes nothing else)
    assert full["queued"] == [(1, False), (0, True)] * micro_batches
    assert full["metrics"]["ratio_mean"] == 1.0 and full["metrics"]["approx_kl"] == 0.0  # π_old's routing, exactly
    for name in ("pg_loss", "grad_norm", "entropy"):
        assert full["metrics"][name] == pytest.approx(plain["metrics"][name], rel=1e-5, abs=1e-7)


def group(weight_version: int) -> RolloutGroup:
    return RolloutGroup(prompt_ids=[5, 6, 7], ground_truth="1", data_source="t", responses=[[7, 8, 9], [3, 4]],
                        engine_logprobs=[[-1.0] * 3, [-1.0] * 2], finish_reasons=["stop"] * 2, accs=[True, False],
                        scores=[1.0, -1.0], overlong_penalties=[0.0] * 2, weight_version=weight_version)


def policy_update_job(hf_dir: str) -> dict:
    config = load_config(TINY_MOE, ["trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=2",
                                    "algorithm.moe_routing_replay=replay_old"])
    actor, _ = build_test_actor(hf_dir, 1, 1, moe_settings())
    stage = PolicyUpdate(actor, config)
    mixed = [group(3), group(2), group(3), group(3)]  # one group of an older version: no reuse with replay
    plan = stage.plan(mixed, step=3)
    samples, forward_only = stage.forward_only_old_logprobs(stage.training_samples(mixed), plan)
    updates, _ = stage.optimizer_updates(samples, plan, forward_only)
    fresh = stage.plan([group(3)] * 4, step=3)
    return dict(reuse=plan.reuse, routed=sorted(plan.routing), forward_only=sorted(forward_only),
                updates=updates, fresh_reuse=fresh.reuse, fresh_first=fresh.mini_batches[0])


def test_policy_update_records_routing_per_mini_batch_and_replays_it(dormant_dir):
    out = run_distributed(policy_update_job, 1, dormant_dir)[0]
    assert not any(out["reuse"]) and out["routed"] == [0, 1] and out["forward_only"] == list(range(8))
    first, second = out["updates"]
    assert first["ratio_mean"] == 1.0  # π_old's routing and weights: exactly its forward
    assert second["ratio_mean"] != 1.0  # the first update moved the weights
    for update in (first, second):
        assert update["moe_aux_loss"] > 0 and update["moe_load_imbalance"] >= 1.0
        assert set(k for k in update if k.startswith("moe_load_imbalance/")) == {"moe_load_imbalance/layer_00",
                                                                                 "moe_load_imbalance/layer_01"}
    # every sample of the current weights: the first mini-batch takes π_old from its own forward
    assert [out["fresh_reuse"][i] for i in out["fresh_first"]] == [True] * 4


def expert_parallel_job(hf_dir: str, expert_parallel: int, aux_loss_coeff: float) -> dict:
    """Two updates on 2 ranks (DP 2) with the experts split over ``expert_parallel`` of them."""
    actor, spec = build_test_actor(hf_dir, 1, 1, moe_settings(replay="none", aux_loss_coeff=aux_loss_coeff),
                                   expert_parallel=expert_parallel)
    samples = random_samples(8, seed=11, vocab_size=VOCAB)
    metrics = [actor.train_minibatch(samples[:4], loss_of()), actor.train_minibatch(samples[4:], loss_of())]
    return dict(metrics=metrics, weights=gather_hf_weights(actor, spec))


@pytest.mark.slow  # 3 × 2 processes
def test_expert_parallel_training_equals_the_same_training_without_it(tmp_path):
    hf_dir = tmp_path / "hf"
    save_random_hf_model(hf_dir, tiny_qwen3_moe_config(num_experts=EVEN_EXPERTS, topk=2, vocab_size=VOCAB,
                                                    num_layers=2), seed=8)
    runs = {(ep, coeff): run_distributed(expert_parallel_job, 2, str(hf_dir), ep, coeff, timeout_s=900)[0]
            for ep, coeff in [(1, 0.0), (2, 0.0), (1, 0.1)]}
    reference, split = runs[1, 0.0], runs[2, 0.0]
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(split["weights"][name], tensor, atol=2e-6, rtol=1e-5, msg=name)
    for expected, got in zip(reference["metrics"], split["metrics"]):
        for key in ("pg_loss", "grad_norm", "moe_aux_loss", "moe_load_imbalance", "moe_load_imbalance/layer_01"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    # control: the load-balancing loss, when weighted in, changes the routers (and only it differs in that run)
    balanced = runs[1, 0.1]["weights"]
    router = "model.layers.0.mlp.gate.weight"
    assert (balanced[router] - reference["weights"][router]).abs().max() > 1e-4
