"""The CPU backend's attention (cpu/attention.py + cpu/segment_packing.py) against the dense computation.

The "segments" layout (attention per sample, each prompt once per row, responses without their last token) must give
the same per-token log-probs and the same parameter gradients as the dense block-diagonal masked square ("mask"
layout of bench/baseline_packing.py, megatron's own DotProductAttention path) and as each sample run alone, up to
float rounding: for samples with
distinct prompts and for groups sharing a prompt, in one row or cut into several padded rows, at TP=1 and TP=2. And
the local spec with RoPE moved into the core attention computes exactly what megatron's stock local model computes.
"""

from __future__ import annotations

import pytest
import torch
from actor_harness import (
    TINY_VOCAB,
    actor_settings,
    build_test_actor,
    logprobs_and_gradients,
    random_samples,
    write_tiny_qwen2,
)
from baseline_packing import MaskPacker, PaddedPacker
from spawn_ranks import run_distributed

from dapo_megatron.policy.packing import PolicySample


def grouped_samples(seed: int) -> list[PolicySample]:
    """3 prompts x 4 responses, interleaved (the packer regroups them); a group's first response has one token, so
    the view owning that prompt holds no response token of its own."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, TINY_VOCAB, (length,), generator=generator) for length in (5, 1, 8)]
    samples = []
    for j in range(4):
        for p, prompt in enumerate(prompts):
            length = 1 if (j, p) == (0, 2) else int(torch.randint(1, 13, (1,), generator=generator))
            samples.append(PolicySample(prompt, torch.randint(0, TINY_VOCAB, (length,), generator=generator),
                                        advantage=float(j - 1.5)))
    return samples


CASES = {"distinct prompts": lambda: random_samples(7, seed=3, prompt_lengths=(1, 9), response_lengths=(1, 25)),
         "shared prompts": lambda: grouped_samples(seed=4)}


def layouts_job(hf_dir: str, tensor_parallel: int):
    """Per case and layout: per-sample log-probs and this rank's parameter gradients of Σ w·log p."""
    from dapo_megatron.cpu.segment_packing import SegmentPacker
    from dapo_megatron.policy.batch_plan import PackedBatching

    actor, _ = build_test_actor(hf_dir, tensor_parallel, 1, actor_settings())
    assert isinstance(actor.backend.packer, SegmentPacker)
    layouts = {"segments, rows of 24": (SegmentPacker(), PackedBatching(token_budget=24, pad_to_multiple=4)),
               "segments, one row": (SegmentPacker(), PackedBatching(token_budget=4096)),
               "mask": (MaskPacker(), PackedBatching(token_budget=64, pad_to_multiple=4)),
               "alone": (PaddedPacker(samples_per_micro_batch=1), PackedBatching(token_budget=4096))}
    results = {}
    for case, make in CASES.items():
        samples = make()
        weights = [torch.rand(s.response_length, generator=torch.Generator().manual_seed(i)) + 0.5
                   for i, s in enumerate(samples)]
        for name, (packer, batching) in layouts.items():
            actor.backend.packer = packer
            result = logprobs_and_gradients(actor, samples, weights, batching, temperature=1.0)
            micro_batches = result["micro_batches"]
            results[case, name] = dict(logprobs=result["logprobs"], grads=result["grads"],
                                       micro_batches=len(micro_batches),
                                       tokens=sum(mb.num_processed_tokens for mb in micro_batches),
                                       classes=max(len(getattr(mb.packed_seq_params, "classes", ()))
                                                   for mb in micro_batches))
    results["leaky"] = leaky_logprobs(actor, CASES["shared prompts"]())
    return results


def leaky_logprobs(actor, samples):
    """Control: the one-row segments micro-batch with ONE view spanning the row, i.e. causal attention across sample
    boundaries (what a broken segment index would compute); per-sample log-probs."""
    from dataclasses import replace

    from dapo_megatron.cpu.segment_packing import SegmentPacker
    from dapo_megatron.policy.batch_plan import PackedBatching

    actor.backend.packer = SegmentPacker()
    (mb,) = actor.plan(samples, PackedBatching(token_budget=4096)).micro_batches
    row = mb.packed_seq_params
    length = row.slot.numel()
    leaky = replace(row, classes=((1, length),), gather=torch.arange(length), slot=torch.arange(length))
    with torch.no_grad():
        logits = actor.model(mb.tokens, mb.position_ids, None, packed_seq_params=leaky)
        rows, _ = actor.response_logprobs(mb, logits, temperature=1.0)
    logprobs = [None] * len(samples)
    for row_number, index in enumerate(mb.sample_indices):
        logprobs[index] = rows[row_number, :samples[index].response_length]
    return logprobs


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(write_tiny_qwen2(tmp_path_factory.mktemp("cpu_attention") / "hf"))


def assert_layouts_agree(results: dict) -> None:
    for case in CASES:
        alone = results[case, "alone"]
        for name in ("segments, rows of 24", "segments, one row", "mask"):
            run = results[case, name]
            for got, want in zip(run["logprobs"], alone["logprobs"], strict=True):
                torch.testing.assert_close(got, want, atol=2e-5, rtol=0, msg=f"{case}, {name}: log-probs")
            for param, grad in alone["grads"].items():
                torch.testing.assert_close(run["grads"][param], grad, atol=2e-5, rtol=1e-4,
                                           msg=f"{case}, {name}: gradient of {param}")
        assert results[case, "segments, rows of 24"]["micro_batches"] > 1
        assert results[case, "segments, one row"]["micro_batches"] == 1
    assert results["distinct prompts", "segments, one row"]["classes"] > 1  # views of several length classes


def test_segments_layout_matches_the_dense_mask_and_each_sample_alone(hf_dir):
    results = run_distributed(layouts_job, 1, hf_dir, 1)[0]
    assert_layouts_agree(results)
    shared = results["shared prompts", "segments, one row"]
    samples = grouped_samples(seed=4)
    # each prompt once, every response without its last token
    assert shared["tokens"] == 5 + 1 + 8 + sum(s.response_length - 1 for s in samples)
    # control: attention leaking across sample boundaries is caught by the same comparison
    alone = results["shared prompts", "alone"]["logprobs"]
    assert max(float((got - want).abs().max()) for got, want in zip(results["leaky"], alone)) > 1e-3


@pytest.mark.slow  # two processes, every layout twice
def test_segments_layout_matches_the_dense_mask_at_tp2(hf_dir):
    for rank_results in run_distributed(layouts_job, 2, hf_dir, 2):
        assert_layouts_agree(rank_results)


def stock_megatron_job(hf_dir: str):
    """Logits of the local spec (RoPE inside the core attention, hand-written RMSNorm and SwiGLU) and of megatron's
    stock local GPTModel (its own RoPE, DotProductAttention, torch RMSNorm, MLP) with the same weights, on
    right-padded rows; and, as the control, of the stock model without RoPE."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    actor, spec = build_test_actor(hf_dir, 1, 1, actor_settings())
    ours = actor.model.module

    def stock(position_embedding_type: str) -> GPTModel:
        model = GPTModel(config=ours.config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=ours.vocab_size, max_sequence_length=spec.max_position_embeddings,
                         share_embeddings_and_output_weights=spec.tie_embeddings,
                         position_embedding_type=position_embedding_type, rotary_base=spec.rope_theta)
        model.load_state_dict(ours.state_dict(), strict=True)
        return model

    tokens = torch.randint(0, TINY_VOCAB, (3, 17), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(17).expand(3, 17)
    with torch.no_grad():
        return [model(tokens, positions, None) for model in (ours, stock("rope"), stock("none"))]


def test_the_local_spec_is_megatrons_stock_local_model(hf_dir):
    ours, stock, unrotated = run_distributed(stock_megatron_job, 1, hf_dir)[0]
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=0)
    # control: the same model without its rotation is far outside that tolerance
    assert (unrotated - stock).abs().max() > 1e-2


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 3)])
def test_explicit_and_flash_class_attention_equal_masked_attention(heads, kv_heads):
    """Both per-class attention paths (explicit scores for small classes, SDPA's flash kernel for large ones) against
    a float64 softmax with a causal mask, values and gradients, grouped query heads included."""
    from dapo_megatron.cpu.attention import causal_attention_explicit, causal_attention_flash

    generator = torch.Generator().manual_seed(0)
    n, length, dim = 5, 11, 8
    q = torch.randn(n, heads, length, dim, generator=generator, requires_grad=True)
    k, v = (torch.randn(n, kv_heads, length, dim, generator=generator, requires_grad=True) for _ in range(2))
    weights = torch.randn(n, heads, length, dim, generator=generator)

    def reference(causal: bool = True):
        group = heads // kv_heads
        qd, kd, vd = (x.double() for x in (q, k, v))
        kd, vd = kd.repeat_interleave(group, dim=1), vd.repeat_interleave(group, dim=1)
        scores = (qd @ kd.transpose(-1, -2)) * 0.3
        if causal:
            scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(scores, dim=-1) @ vd

    def value_and_grads(attention):
        out = attention(q, k, v, 0.3)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        return out.double(), [g.double() for g in grads]

    want, want_grads = value_and_grads(lambda *args: reference())
    for attention in (causal_attention_explicit, causal_attention_flash):
        got, got_grads = value_and_grads(attention)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    # control: without the causal mask the same comparison fails
    assert (reference(causal=False) - want).abs().max() > 1e-2


def test_segmented_row_layout():
    from dapo_megatron.cpu import segment_packing
    from dapo_megatron.cpu.segment_packing import segment_bins, segmented_row

    prompt = torch.tensor([1, 2, 3])
    samples = [PolicySample(prompt, torch.tensor([4, 5])), PolicySample(torch.tensor([9]), torch.tensor([8, 7, 6])),
               PolicySample(prompt, torch.tensor([6])), PolicySample(prompt, torch.tensor([7, 8, 9]))]
    (members,) = segment_bins(samples, range(4), token_budget=64)
    assert members == [0, 2, 3, 1]  # grouped by prompt, first appearance first
    mb = segmented_row(samples, members, pad_to_multiple=4)
    # prompt once, responses without their last token, then the other prompt, then padding to 12
    assert mb.tokens[0].tolist() == [1, 2, 3, 4, 7, 8, 9, 8, 7, 0, 0, 0]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 3, 4, 0, 1, 2, 0, 1, 2]
    row = mb.packed_seq_params
    # views: sample 0 (prompt + 1), sample 3 (prompt + 2), the other prompt + 2, padding; sample 2 (one token, not
    # the prompt's owner) needs none. Length classes: the views of 5, 4 and 3 tokens, then padding (3 tokens too)
    assert row.classes == ((4, 5),)
    assert segment_packing.length_classes([9, 4, 5, 2, 8]) == [([0, 4, 2], 9), ([1, 3], 4)]
    assert torch.equal(row.gather[row.slot], torch.arange(12))  # each position's output slot reads that position
    assert len(set(row.slot.tolist())) == 12
    valid = mb.response_valid
    assert mb.response_ids[valid].tolist() == [4, 5, 6, 7, 8, 9, 8, 7, 6]
    # response token t is predicted at the prompt's end (t = 0) or at its own previous token
    assert mb.response_index[valid].tolist() == [2, 3, 2, 2, 4, 5, 6, 7, 8]
    assert mb.num_real_tokens == 9

    assert mb.labels[0, mb.response_index[valid]].tolist()[:2] == [4, 5]  # a shared prompt's end: its owner's token

    # a group over the budget is cut into units that each repeat the prompt: [0, 2] (3 + 1 + 0 tokens), [3] (3 + 2)
    assert segment_bins(samples, range(4), token_budget=5) == [[3], [0, 2], [1]]
