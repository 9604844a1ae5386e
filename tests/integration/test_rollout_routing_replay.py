"""R3 (``algorithm.moe_routing_replay: replay_rollout``) end to end on CPU: the embedded engine samples from a tiny
Qwen3-MoE and records its routing; the trainer replays it in π_old's forward at TP2 × EP2 on 4 gloo ranks, and in
π_old's forward and the updates at EP2 (DP2) on 2 (trainer/policy_update.py, policy/rollout_routing.py). On CPU
megatron-core's MoE layer trains at TP > 1 only under sequence parallelism, which needs Transformer Engine's spec,
and its all-to-all dispatcher with sequence parallelism forced on the CPU spec fails in gloo's all-gather (uneven
token counts, without replay too): TP2 is checked on π_old's forward-only pass, which is where R3's layout differs.

The drift between engine and trainer is made real the way test_policy_moe_training.py makes it between π_old and the
update: the routers are built so that expert 0 is never among any token's top 2 (its router row is zero, experts 1-4
come in ± pairs), the engine samples with them, and the trainer's copy has expert 0's row raised so that its own
routing sends many tokens there — as a numerically different engine does at near-ties, on every token. Nothing else
differs, and with Qwen3's top-k softmax the replayed gates never read expert 0's score: with R3 the trainer's
log-probs of the engine's tokens equal the engine's to float tolerance; without replay (the control, the unreplayed
forward of the same step) they do not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spawn_ranks import run_distributed
from tiny_qwen3 import write_dormant_expert_model as write_dormant_model, EVEN_EXPERTS

from dapo_megatron.collectors.group import RolloutGroup

TINY_MOE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu_moe.yaml"
VOCAB = 101


def write_dormant_expert_model(directory: Path) -> Path:
    return write_dormant_model(directory, num_experts=EVEN_EXPERTS, vocab_size=VOCAB)


def engine_groups(hf_dir: str) -> list[RolloutGroup]:
    from dapo_megatron.rollout import SamplingParams
    from dapo_megatron.rollout.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine.from_hf_directory(hf_dir)
    engine.return_routed_experts = True
    prompts = [[5, 6, 7, 8], [11, 3, 9], [20, 21, 22, 23, 24], [40, 41]]
    generated = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7))
    return [RolloutGroup(prompt_ids=prompt, ground_truth="1", data_source="t",
                         responses=[s.token_ids for s in samples], engine_logprobs=[s.logprobs for s in samples],
                         finish_reasons=[s.finish_reason for s in samples], accs=[True, False], scores=[1.0, -1.0],
                         overlong_penalties=[0.0, 0.0], weight_version=0,
                         routed_experts=[s.routed_experts for s in samples])
            for prompt, samples in zip(prompts, generated)]


def moe_actor(hf_dir: str, tensor_parallel: int):
    """An fp32 actor at TP``tensor_parallel`` × EP2 with routing replay (the TP layout is built directly: build_actor
    refuses TP > 1 for a MoE model on CPU, which could not train it)."""
    from dapo_megatron.config import OptimConfig
    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.policy.actor import Actor
    from dapo_megatron.policy.batch_plan import PackedBatching
    from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec
    from dapo_megatron.policy.model import build_model, transformer_config
    from dapo_megatron.policy.optimizer import wrap_for_training

    backend = init_distributed(tensor_parallel, 1, expert_parallel=2).backend
    seed_everything(0)
    spec = load_model_spec(hf_dir)
    tconfig = transformer_config(spec, backend, tensor_parallel=tensor_parallel, pipeline_parallel=1,
                                 sequence_parallel=False,
                                 recompute="none", expert_parallel=2, moe_routing_replay=True)
    model, optimizer, scheduler = wrap_for_training(
        build_model(spec, tconfig, backend), OptimConfig(lr=1e-2, adam_eps=1e-3, grad_clip=1e6, weight_decay=0.0),
        use_distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False)
    load_hf_weights(model, spec, hf_dir)
    optimizer.reload_model_params()
    return Actor(model, optimizer, scheduler, backend=backend, real_vocab_size=spec.vocab_size,
                 batching=PackedBatching(token_budget=4096), temperature=1.0)


def r3_job(hf_dir: str, tensor_parallel: int) -> dict:
    from dapo_megatron.config import load_config
    from dapo_megatron.metrics.step import StepTimer
    from dapo_megatron.policy.moe_routing import moe_routers
    from dapo_megatron.trainer.policy_update import PolicyUpdate

    from dapo_megatron.collectors.batch import hand_over_rollouts

    actor = moe_actor(hf_dir, tensor_parallel)
    # as the trainer hands a step's batch over: rank 0 generates, and only it keeps the routing's values
    groups, _ = hand_over_rollouts(lambda: (engine_groups(hf_dir), {}), what="the test's rollouts")
    held = {r.device.type for g in groups for r in g.routed_experts}
    with torch.no_grad():  # the trainer's routers now prefer expert 0 where the engine's never chose it
        for router in moe_routers(actor.model):
            router.weight[0] = 4.0 * (router.weight[1] + router.weight[3])
    config = load_config(TINY_MOE, ["trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=2",
                                    "algorithm.moe_routing_replay=replay_rollout",
                                    "algorithm.overlong_filtering=false"])  # the responses stop at max_new_tokens
    stage = PolicyUpdate(actor, config)
    if tensor_parallel == 1:  # the whole stage: π_old, the diagnostics, the updates
        update = stage.run(groups, step=0, timer=StepTimer())
        old, routing, updates = [s.old_logprobs for s in update.samples], update.routing, update.updates
    else:  # π_old's forward-only passes and the diagnostics
        plan = stage.plan(groups, step=0)
        samples, _ = stage.forward_only_old_logprobs(stage.training_samples(groups), plan)
        old, routing, updates = [s.old_logprobs for s in samples], stage.unreplayed_gap(samples, groups, plan, 0), []
    engine = [torch.as_tensor(lps, dtype=torch.float32) for g in groups for lps in g.engine_logprobs]
    gap = max(float((e - lp).abs().max()) for e, lp in zip(engine, old))
    engine_experts = (sorted(set(torch.cat([r.flatten() for g in groups for r in g.routed_experts]).tolist()))
                      if held == {"cpu"} else None)
    return dict(gap=gap, routing=routing, updates=updates, engine_experts=engine_experts, held=held)


@pytest.fixture(scope="module")
def dormant_dir(tmp_path_factory):
    return str(write_dormant_expert_model(tmp_path_factory.mktemp("r3") / "hf"))


@pytest.mark.slow  # 4 + 2 ranks
@pytest.mark.parametrize("tensor_parallel", [2, 1])
def test_r3_trainer_logprobs_equal_the_engines_where_unreplayed_routing_drifts(dormant_dir, tensor_parallel):
    out = run_distributed(r3_job, 2 * tensor_parallel, dormant_dir, tensor_parallel, timeout_s=900)
    assert all(rank["routing"] == out[0]["routing"] for rank in out)  # the same metrics on every rank
    # the routing's values stayed on rank 0; each other rank got its rows from there (policy/rollout_routing.py)
    assert out[0]["held"] == {"cpu"} and all(rank["held"] == {"meta"} for rank in out[1:])
    out = out[0]
    assert 0 not in out["engine_experts"]  # the engine never routed to expert 0
    assert out["gap"] < 1e-4  # replayed: the engine's own log-probs, to float tolerance
    routing = out["routing"]
    assert routing["rollout/logprob_diff_unreplayed/max_abs"] > 1e-2  # control: routing by itself, it drifts
    assert 0.0 < routing["rollout/routing_agreement"] < 0.9  # many (token, layer) decisions flipped to expert 0
    if tensor_parallel == 1:
        first, second = out["updates"]
        assert first["ratio_mean"] == 1.0 and first["approx_kl"] == 0.0  # π_old's replayed routing, exactly
        assert second["ratio_mean"] != 1.0


ASYNC_MOE = ["model.tiny.arch=qwen3_moe", "model.tiny.hidden_size=32", "model.tiny.num_layers=2",
             "model.tiny.head_dim=16", "model.tiny.num_experts=4", "model.tiny.num_experts_per_tok=2",
             "model.tiny.moe_intermediate_size=32", "warm_start.enabled=false", "trainer.total_steps=3",
             "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
             "data.synthetic.num_train=200", "data.synthetic.num_heldout=8", "eval.every=0",
             "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4", "algorithm.dynamic_sampling=false",
             "algorithm.moe_routing_replay=replay_rollout", "rollout.mode=async", "rollout.partial_rollouts=false"]


@pytest.mark.slow  # a CLI run
def test_r3_trains_in_async_mode_on_whole_responses_of_older_weights(tmp_path):
    """Async mode without partial rollouts: every response was sampled, and routed, by one weight version, which
    its replay reproduces even when the policy has moved on since (the stale steps)."""
    from cli_runs import TINY, check_run, read_run_metrics

    check_run("train", str(TINY), *ASYNC_MOE, f"trainer.run_dir={tmp_path / 'run'}", timeout=1200)
    rows = read_run_metrics(tmp_path / "run")[1:]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["rollout/routing_agreement"] > 0.9 for row in rows)  # fp32 engine and trainer route alike
    assert max(row["rollout/staleness/max"] for row in rows) >= 1  # some responses came from older weights
