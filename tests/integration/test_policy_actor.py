"""The actor's DAPO step through megatron's schedule: the objective is exactly Σ m·ℓ / N_global for every split of
the mini-batch (1 or 4 micro-batches, 1 or 2 DP ranks, TP=2/PP=2), compared on full HF-named gradients and updated
weights against an independent reference; forward-only log-probs; the NaN guard; the LR warmup."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from actor_harness import (
    TINY_VOCAB,
    actor_settings,
    build_test_actor,
    gather_hf_weights,
    loss_of,
    random_samples,
    write_tiny_qwen2,
)
from spawn_ranks import run_distributed

NUM_SAMPLES = 8
SAMPLE_SEED = 11


def actor_config(token_budget: int = 4096, lr_warmup_steps: int = 0, distributed_optimizer: bool = False) -> dict:
    from dapo_megatron.config import OptimConfig, ParallelConfig

    # Adam eps ~ the gradient scale makes the first update depend on |g| (with a tiny eps it is lr·sign(g) and would
    # hide a wrong gradient scale); clip_grad far above the norm keeps main_grad unclipped for the comparison.
    return actor_settings(
        optim=OptimConfig(lr=1e-2, weight_decay=0.1, adam_eps=1e-3, grad_clip=1e6, warmup_steps=lr_warmup_steps),
        parallel=ParallelConfig(use_distributed_optimizer=distributed_optimizer),
        micro_batch_tokens=token_budget,
        temperature=0.9,
    )


def budget_for(samples, micro_batches: int) -> int:
    """The smallest token budget that packs ``samples`` into exactly ``micro_batches`` micro-batches (one DP rank,
    the CPU backend's segments layout)."""
    from dapo_megatron.cpu.segment_packing import segment_bins

    lengths = [s.length for s in samples]
    return next(b for b in range(1, sum(lengths) + 1)
                if len(segment_bins(samples, range(len(samples)), b)) == micro_batches)


def hf_gradients(actor, spec):
    """Full HF-named gradients: main_grad copied into the (throw-away) parameters, then exported like weights."""
    with torch.no_grad():
        for param in actor.model.parameters():
            param.copy_(param.main_grad)
    return gather_hf_weights(actor, spec)


def one_step(hf_dir, tp, pp, config, agg: str = "token-mean"):
    """Forward-only log-probs, one update; returns log-probs, metrics, HF weights after and HF gradients.

    With the distributed optimizer ``main_grad`` is only reduced in each rank's own shard: no gradients then.
    """
    samples = random_samples(NUM_SAMPLES, seed=SAMPLE_SEED)
    actor, spec = build_test_actor(hf_dir, tp, pp, config)
    logprobs = actor.compute_logprobs(samples)
    metrics = actor.train_minibatch(samples, loss_of(loss_agg=agg))
    weights = gather_hf_weights(actor, spec)
    grads = None if config["parallel"].use_distributed_optimizer else hf_gradients(actor, spec)
    return dict(logprobs=logprobs.logprobs, metrics=metrics, weights=weights, grads=grads)


def reference_step(hf_dir):
    """Σ m·ℓ / N and its gradient computed directly: each sample alone through the model, full log_softmax."""
    from dapo_megatron.algorithm import policy_loss
    from dapo_megatron.config import AlgorithmConfig

    config = actor_config()
    samples = random_samples(NUM_SAMPLES, seed=SAMPLE_SEED)
    actor, spec = build_test_actor(hf_dir, 1, 1, config)
    actor.model.zero_grad_buffer()
    width = max(s.response_length for s in samples)
    logprobs = torch.zeros(len(samples), width)
    mask, old, advantages = (torch.zeros(len(samples), width) for _ in range(3))
    rows = []
    for i, s in enumerate(samples):
        tokens = torch.cat([s.prompt_ids, s.response_ids])[None]
        logits = actor.model(tokens, torch.arange(tokens.shape[1])[None], None)[0, :, :TINY_VOCAB]
        logp = torch.log_softmax(logits.float() / config["temperature"], dim=-1)
        rows.append(logp[s.prompt_length - 1:-1].gather(-1, s.response_ids[:, None])[:, 0])
        r = s.response_length
        mask[i, :r], old[i, :r], advantages[i, :r] = s.response_tensors()
    logprobs = torch.stack([torch.nn.functional.pad(row, (0, width - row.numel())) for row in rows])
    a = AlgorithmConfig(clip_ratio_c=None)
    loss, metrics = policy_loss(logprobs, old, advantages, mask, eps_low=a.eps_low, eps_high=a.eps_high,
                                clip_ratio_c=a.clip_ratio_c, agg=a.aggregation)
    loss.backward()
    return dict(loss=float(loss), metrics=metrics, logprobs=[row.detach() for row in rows],
                grads=hf_gradients(actor, spec))


def world_one_job(hf_dir):
    """Reference; 1 and 4 micro-batches (token-mean and seq-mean-token-mean); the NaN guard; the warmup."""
    samples = random_samples(NUM_SAMPLES, seed=SAMPLE_SEED)
    four = budget_for(samples, 4)
    results = dict(
        reference=reference_step(hf_dir),
        one=one_step(hf_dir, 1, 1, actor_config()),
        four=one_step(hf_dir, 1, 1, actor_config(token_budget=four)),
        seq_one=one_step(hf_dir, 1, 1, actor_config(), agg="seq-mean-token-mean"),
        seq_four=one_step(hf_dir, 1, 1, actor_config(token_budget=four), agg="seq-mean-token-mean"),
    )

    # NaN guard: a non-finite advantage makes the loss and gradients NaN; the step must be skipped.
    from dapo_megatron.policy.packing import PolicySample

    actor, _ = build_test_actor(hf_dir, 1, 1, actor_config(lr_warmup_steps=2))
    before = [p.detach().clone() for p in actor.model.parameters()]
    poisoned = list(samples)
    poisoned[3] = PolicySample(samples[3].prompt_ids, samples[3].response_ids, advantage=float("nan"),
                               old_logprobs=samples[3].old_logprobs)
    nan_metrics = actor.train_minibatch(poisoned, loss_of())
    unchanged = all(torch.equal(a, b) for a, b in zip(before, actor.model.parameters()))
    grads_zeroed = all(not p.main_grad.any() for p in actor.model.parameters())
    scheduler_steps = actor.scheduler.num_steps
    after = [actor.train_minibatch(samples, loss_of()) for _ in range(3)]
    finite = all(torch.isfinite(p).all() for p in actor.model.parameters())
    changed = not all(torch.equal(a, b) for a, b in zip(before, actor.model.parameters()))
    results["guard"] = dict(nan_metrics=nan_metrics, unchanged=unchanged, grads_zeroed=grads_zeroed,
                            scheduler_steps=scheduler_steps, after=after, finite=finite, changed=changed)
    return results


def data_parallel_job(hf_dir):
    return dict(plain=one_step(hf_dir, 1, 1, actor_config()),
                distopt=one_step(hf_dir, 1, 1, actor_config(distributed_optimizer=True)))


def tp2_pp2_job(hf_dir):
    return one_step(hf_dir, 2, 2, actor_config(token_budget=40))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(write_tiny_qwen2(tmp_path_factory.mktemp("actor") / "hf"))


@pytest.fixture(scope="module")
def world_one(hf_dir):
    return run_distributed(world_one_job, 1, hf_dir)[0]


@pytest.fixture(scope="module")
def data_parallel(hf_dir):
    return run_distributed(data_parallel_job, 2, hf_dir)


def assert_same_tensors(actual: dict, expected: dict, atol: float, what: str):
    assert actual.keys() == expected.keys(), what
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], atol=atol, rtol=1e-4, err_msg=f"{what}: {name}")


def test_loss_and_gradient_equal_the_direct_reference(world_one):
    reference = world_one["reference"]
    for name in ("one", "four"):
        run = world_one[name]
        assert run["metrics"]["pg_loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-7)
        for metric in ("clipfrac_high", "clipfrac_low", "approx_kl", "ratio_mean"):
            assert run["metrics"][metric] == pytest.approx(reference["metrics"][metric], rel=1e-5, abs=1e-7)
        assert_same_tensors(run["grads"], reference["grads"], atol=1e-6, what=f"{name} micro-batch gradients")
        for got, want in zip(run["logprobs"], reference["logprobs"]):
            np.testing.assert_allclose(got, want, atol=1e-5)
    assert world_one["one"]["metrics"]["num_micro_batches"] == 1
    assert world_one["four"]["metrics"]["num_micro_batches"] == 4
    assert world_one["one"]["metrics"]["clipfrac_high"] + world_one["one"]["metrics"]["clipfrac_low"] > 0
    grad_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in reference["grads"].values()))
    assert world_one["one"]["metrics"]["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)


def test_micro_batch_and_data_parallel_splits_give_the_same_update(world_one, data_parallel):
    one = world_one["one"]
    four = world_one["four"]
    assert_same_tensors(four["weights"], one["weights"], atol=1e-6, what="4 vs 1 micro-batches, weights")
    seq_one, seq_four = world_one["seq_one"], world_one["seq_four"]
    assert seq_one["metrics"]["pg_loss"] != pytest.approx(one["metrics"]["pg_loss"])  # a different objective
    assert seq_four["metrics"]["pg_loss"] == pytest.approx(seq_one["metrics"]["pg_loss"], rel=1e-5)
    assert_same_tensors(seq_four["grads"], seq_one["grads"], atol=1e-6, what="seq-mean 4 vs 1, gradients")

    for optimizer in ("plain", "distopt"):
        dp_rank0, dp_rank1 = (rank[optimizer] for rank in data_parallel)
        assert dp_rank1["weights"] is None  # the exporter gathers on rank 0 only
        for metric in ("pg_loss", "grad_norm", "clipfrac_high", "clipfrac_low", "approx_kl", "entropy", "num_tokens"):
            assert dp_rank0["metrics"][metric] == pytest.approx(one["metrics"][metric], rel=1e-5, abs=1e-7), metric
            assert dp_rank1["metrics"][metric] == dp_rank0["metrics"][metric], metric
        assert_same_tensors(dp_rank0["weights"], one["weights"], atol=1e-6, what=f"DP=2 {optimizer} weights")
        for got, want in zip(dp_rank1["logprobs"], one["logprobs"]):  # every rank gets every sample's log-probs
            np.testing.assert_allclose(got, want, atol=1e-5)
    assert_same_tensors(data_parallel[0]["plain"]["grads"], one["grads"], atol=1e-6, what="DP=2 gradients")


@pytest.mark.slow  # 4 processes
def test_tp2_pp2_matches_tp1_pp1(world_one, hf_dir):
    one = world_one["one"]
    ranks = run_distributed(tp2_pp2_job, 4, hf_dir)
    assert_same_tensors(ranks[0]["grads"], one["grads"], atol=1e-6, what="TP=2/PP=2 gradients")
    assert_same_tensors(ranks[0]["weights"], one["weights"], atol=1e-6, what="TP=2/PP=2 weights")
    for rank in ranks:
        assert rank["metrics"]["pg_loss"] == pytest.approx(one["metrics"]["pg_loss"], rel=1e-5)
        assert rank["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)
        for got, want in zip(rank["logprobs"], one["logprobs"]):
            np.testing.assert_allclose(got, want, atol=1e-5)
    assert ranks[0]["metrics"]["num_micro_batches"] > 1


def test_non_finite_step_is_skipped_and_training_resumes(world_one):
    guard = world_one["guard"]
    assert guard["nan_metrics"]["skipped"] == 1.0
    assert not math.isfinite(guard["nan_metrics"]["pg_loss"])
    assert guard["unchanged"] and guard["grads_zeroed"]
    assert guard["scheduler_steps"] == 0
    assert [m["skipped"] for m in guard["after"]] == [0.0, 0.0, 0.0]
    assert [m["lr"] for m in guard["after"]] == pytest.approx([5e-3, 1e-2, 1e-2])  # warmup over 2 applied updates
    assert guard["finite"] and guard["changed"]


def test_response_logprobs_keep_no_padded_copy_of_the_logits():
    """Issue 26, item 2: one long response packed with short ones pads the micro-batch's [n, R] response tensors to the
    long one; the log-probs must not gather (and keep for backward) logits at every padded position — that copy was
    several times the row's logits. They read the row's logits in place and scatter back into [n, R]."""
    from types import SimpleNamespace

    from saved_tensors import logits_sized_copies, saved_during

    from dapo_megatron.policy.actor import Actor
    from dapo_megatron.policy.logprobs import vocab_parallel_logprobs
    from dapo_megatron.policy.memory.gpu import logprob_buffers
    from dapo_megatron.policy.packing import PolicySample, ThdPacker

    vocab, generator = 64, torch.Generator().manual_seed(4)
    lengths = [(3, 40), (2, 2), (4, 1), (2, 3), (3, 2)]  # (prompt, response): one long response, four short ones
    samples = [PolicySample(torch.randint(0, vocab, (p,), generator=generator),
                            torch.randint(0, vocab, (r,), generator=generator)) for p, r in lengths]
    mb = ThdPacker().row(samples, list(range(len(samples))), pad_to_multiple=8)
    assert mb.response_index.numel() > mb.tokens.numel()  # [n, R] padded past the row itself
    logits = torch.randn(1, mb.sequence_length, vocab, generator=generator, requires_grad=True)
    actor = SimpleNamespace(real_vocab_size=vocab)
    (logprobs, entropy), saved = saved_during(lambda: Actor.response_logprobs(actor, mb, logits, 0.8))
    assert logits_sized_copies(saved, logits) == []
    assert logprobs.shape == mb.response_valid.shape and not logprobs[~mb.response_valid].any()

    flat = logits.detach().reshape(-1, vocab)
    for row, sample in enumerate(samples):  # each response on its own, from its own positions
        positions = mb.response_index[row, :sample.response_length]
        expected, expected_entropy = vocab_parallel_logprobs(flat[positions], sample.response_ids,
                                                             real_vocab_size=vocab, temperature=0.8)
        torch.testing.assert_close(logprobs[row, :sample.response_length], expected)
        torch.testing.assert_close(entropy[row, :sample.response_length], expected_entropy)
    (logprobs * mb.response_valid).sum().backward()
    touched = logits.grad.reshape(-1, vocab).abs().sum(-1) > 0
    assert touched.nonzero().flatten().tolist() == sorted(mb.response_index[mb.response_valid].tolist())

    # What `dapo-megatron plan` counts for it (policy/memory/gpu.py): the logits kept and their gradient, nothing more.
    vocab_wide = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for t in saved if t.shape[-1:] == (vocab,)}
    counted = logprob_buffers(logits.numel(), logits.element_size())
    assert sum(vocab_wide.values()) == counted["logits"] and logits.grad.nbytes == counted["gradient"]
