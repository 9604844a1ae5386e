"""Micro-batches: bin packing, DP balance, the THD layout and the baselines (bench/baseline_packing.py), and
log-prob parity with the model for the CPU backend's packed layout."""

from __future__ import annotations

import warnings

import pytest
import torch
from actor_harness import TINY_VOCAB, random_samples, write_tiny_qwen2
from baseline_packing import MaskPacker, PaddedPacker
from spawn_ranks import run_distributed

from dapo_megatron.policy.batch_plan import PackedBatching, plan_data_parallel, split_for_data_parallel
from dapo_megatron.policy.packing import (
    PolicySample,
    ThdPacker,
    first_fit_decreasing,
    pack_micro_batches,
    packing_efficiency,
)


def sample(prompt: int, response: int, start: int = 1, **kwargs) -> PolicySample:
    return PolicySample(torch.arange(start, start + prompt), torch.arange(start + prompt, start + prompt + response),
                        **kwargs)


def test_first_fit_decreasing_respects_the_budget_and_is_deterministic():
    lengths = [7, 3, 9, 2, 5, 5, 1, 8]
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert [[lengths[i] for i in b] for b in bins] == [[9, 1], [8, 2], [7, 3], [5, 5]]
    assert bins == first_fit_decreasing(lengths, 10)
    assert bins[0][0] == 2  # longest first


def test_oversize_sample_gets_its_own_micro_batch_with_a_warning():
    with pytest.warns(UserWarning, match="sample 1 has 12 tokens, more than the micro-batch token budget 10"):
        bins = first_fit_decreasing([3, 12, 4], 10)
    assert [1] in bins and len(bins) == 2


def test_data_parallel_split_balances_tokens():
    lengths = [50, 10, 40, 30, 20, 20, 10, 5]
    shares = split_for_data_parallel(lengths, 2)
    loads = [sum(lengths[i] for i in share) for share in shares]
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    assert abs(loads[0] - loads[1]) <= 5
    assert shares == split_for_data_parallel(lengths, 2)


def test_every_dp_rank_gets_the_same_number_of_micro_batches():
    # One long sample and many short ones: rank 0 packs the long one alone, rank 1 needs more micro-batches.
    samples = [sample(4, 26)] + [sample(2, 3, start=i) for i in range(6)]
    config = PackedBatching(token_budget=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 30-token sample is over the budget
        plans = [plan_data_parallel(samples, config, ThdPacker(), data_parallel=2, data_parallel_rank=r)
                 for r in range(2)]
    counts = [len(plan.micro_batches) for plan in plans]
    assert counts[0] == counts[1]
    assert sum(plan.num_empty for plan in plans) > 0
    assert sorted(i for plan in plans for mb in plan.micro_batches for i in mb.sample_indices) == list(range(7))
    assert all(plan.num_loss_tokens == 26 + 6 * 3 for plan in plans)
    # An empty micro-batch has no sample and no loss token, but a token for the model to run on.
    empty = [mb for plan in plans for mb in plan.micro_batches if mb.num_samples == 0]
    assert empty and all(mb.loss_mask.sum() == 0 and mb.tokens.numel() >= 1 for mb in empty)


def test_packed_row_layout_mask():
    samples = [sample(2, 3), sample(3, 2, start=20)]
    (mb,) = pack_micro_batches(samples, MaskPacker(), token_budget=16, pad_to_multiple=4)
    assert mb.tokens.shape == (1, 12) and mb.num_real_tokens == 10
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    mask = mb.attention_mask[0, 0]
    assert mb.attention_mask.shape == (1, 1, 12, 12) and mask.dtype == torch.bool
    for q in range(12):
        for k in range(12):
            same = (q < 5 and k < 5) or (5 <= q < 10 and 5 <= k < 10) or (q >= 10 and k >= 10)
            assert bool(mask[q, k]) == (not (same and k <= q)), (q, k)
    # The logits at response_index predict the response tokens; padding is outside every response.
    for row, index in enumerate(mb.sample_indices):
        valid = mb.response_valid[row]
        assert torch.equal(mb.labels.view(-1)[mb.response_index[row][valid]], samples[index].response_ids)
    assert packing_efficiency([mb]) == pytest.approx(10 / 12)


def test_packed_row_layout_thd():
    samples = [sample(2, 3), sample(3, 2, start=20)]
    (mb,) = pack_micro_batches(samples, ThdPacker(), token_budget=16, pad_to_multiple=4)
    params = mb.packed_seq_params
    assert mb.attention_mask is None and params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 5, 10, 12] and params.cu_seqlens_q.dtype == torch.int32
    assert params.max_seqlen_q == 5 and params.segment_lengths == (5, 5, 2)
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    for row, index in enumerate(mb.sample_indices):
        valid = mb.response_valid[row]
        assert torch.equal(mb.labels.view(-1)[mb.response_index[row][valid]], samples[index].response_ids)
    moved = mb.to("cpu").packed_seq_params  # what the actor does before the forward keeps the host-side lengths
    assert moved.segment_lengths == (5, 5, 2) and torch.equal(moved.cu_seqlens_kv, params.cu_seqlens_kv)


def test_padded_micro_batches_one_sample_per_row():
    samples = [sample(2, 3), sample(3, 6), sample(1, 1)]
    micro_batches = pack_micro_batches(samples, PaddedPacker(samples_per_micro_batch=2), token_budget=1)
    assert [mb.tokens.shape for mb in micro_batches] == [(2, 9), (1, 2)]
    assert micro_batches[0].attention_mask is None
    first = micro_batches[0]
    for row, index in enumerate(first.sample_indices):
        valid = first.response_valid[row]
        assert torch.equal(first.labels.view(-1)[first.response_index[row][valid]], samples[index].response_ids)
    assert packing_efficiency(micro_batches) == pytest.approx(16 / 20)


def test_loss_inputs_carry_mask_old_logprobs_and_advantages():
    one = sample(2, 3, advantage=0.5, old_logprobs=[-1.0, -2.0, -3.0], loss_mask=[1, 0, 1])
    two = sample(2, 2, advantage=torch.tensor([1.0, 2.0]))
    (mb,) = pack_micro_batches([one, two], ThdPacker(), token_budget=32)
    rows = {index: row for row, index in enumerate(mb.sample_indices)}
    assert mb.loss_mask[rows[0]].tolist() == [1, 0, 1]
    assert mb.old_logprobs[rows[0]].tolist() == [-1, -2, -3]
    assert mb.advantages[rows[0]].tolist() == [0.5] * 3
    assert mb.advantages[rows[1], :2].tolist() == [1, 2] and mb.loss_mask[rows[1]].tolist() == [1, 1, 0]


def test_bad_samples_are_named():
    with pytest.raises(ValueError, match="response_ids is empty"):
        PolicySample([1, 2], [])
    with pytest.raises(ValueError, match="old_logprobs has 2 entries for 3 response tokens"):
        PolicySample([1], [1, 2, 3], old_logprobs=[0.0, 0.0])
    with pytest.raises(ValueError, match=r"sample 1: response_ids has ids outside \[0, 10\)"):
        pack_micro_batches([sample(1, 1), sample(1, 10)], ThdPacker(), token_budget=32, vocab_size=10)


@pytest.mark.parametrize("packer", [ThdPacker(), MaskPacker(), PaddedPacker(samples_per_micro_batch=2)],
                         ids=["thd", "mask", "padded"])
def test_the_filler_micro_batch_has_no_samples(packer):
    mb = packer.row([sample(1, 1)], [], 2)
    assert mb.num_samples == 0 and mb.tokens.shape == (1, 2) and mb.num_real_tokens == 0


def packed_parity_job(hf_dir: str):
    """TP=2, the CPU backend's model: log-probs of each sample alone, in a packed micro-batch (the backend's
    segments layout), in a padded one and in the dense block-diagonal reference."""
    from actor_harness import actor_settings, build_test_actor

    from dapo_megatron.cpu.segment_packing import SegmentPacker

    samples = random_samples(7, seed=3, prompt_lengths=(1, 9), response_lengths=(1, 25))

    def logprobs(packer):
        actor.backend.packer = packer
        return actor.compute_logprobs(samples, temperature=0.8,
                                      batching=PackedBatching(token_budget=64, pad_to_multiple=4))

    actor, _ = build_test_actor(hf_dir, 2, 1, actor_settings())
    assert isinstance(actor.backend.packer, SegmentPacker)
    alone = logprobs(PaddedPacker(samples_per_micro_batch=1))
    packed = logprobs(SegmentPacker())
    padded = logprobs(PaddedPacker(samples_per_micro_batch=3))
    masked = logprobs(MaskPacker())
    return [alone.logprobs, alone.entropy, packed.logprobs, packed.entropy, padded.logprobs, masked.logprobs]


def test_packed_logprobs_equal_each_sample_run_alone_and_the_hf_model(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = write_tiny_qwen2(tmp_path / "hf")
    results = run_distributed(packed_parity_job, 2, str(hf_dir))
    alone, alone_entropy, packed, packed_entropy, padded, masked = results[0]
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert hf.config.vocab_size == TINY_VOCAB
    for i, s in enumerate(random_samples(7, seed=3, prompt_lengths=(1, 9), response_lengths=(1, 25))):
        assert alone[i].shape == (s.response_length,)
        torch.testing.assert_close(packed[i], alone[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(packed_entropy[i], alone_entropy[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(padded[i], alone[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(masked[i], alone[i], atol=1e-5, rtol=0)
        with torch.no_grad():
            logits = hf(torch.cat([s.prompt_ids, s.response_ids])[None]).logits[0].double() / 0.8
        expected = torch.log_softmax(logits, -1)[s.prompt_length - 1:-1].gather(-1, s.response_ids[:, None])[:, 0]
        torch.testing.assert_close(alone[i].double(), expected, atol=2e-5, rtol=0)
    for other_rank in results[1:]:  # every rank gets the same log-probs
        assert all((a == b).all() for a, b in zip(other_rank[2], results[0][2]))
