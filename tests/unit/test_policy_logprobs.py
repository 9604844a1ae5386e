"""Vocab-parallel log-probs and entropy vs a full-vocabulary ``log_softmax`` reference (values and gradients)."""

from __future__ import annotations

import pytest
import torch
from saved_tensors import logits_sized_copies, saved_during
from spawn_ranks import run_distributed

from dapo_megatron.policy.logprobs import temperature_scale, vocab_parallel_logprobs

REAL_VOCAB = 101
PADDED_VOCAB = 256  # 101 padded for TP=2: rank 1's slice [128, 256) is all padding


def reference(logits: torch.Tensor, target: torch.Tensor, real_vocab: int, temperature: float):
    """log_softmax over the real vocabulary of logits / T, and the entropy of that distribution."""
    z = logits[..., :real_vocab].double() * temperature_scale(temperature)
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, target[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def make_inputs(seed: int, rows: int = 2, cols: int = 7):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, cols, PADDED_VOCAB, generator=generator) * 3
    logits[..., REAL_VOCAB:] = 50.0  # padding rows with large logits: any leak into the softmax shows
    target = torch.randint(0, REAL_VOCAB, (rows, cols), generator=generator)
    target[0, 0], target[0, 1] = 0, REAL_VOCAB - 1  # vocabulary edges
    return logits, target


def test_temperature_scale_follows_the_rollout_engine():
    assert temperature_scale(0.0) == 1.0 and temperature_scale(1.0) == 1.0
    assert temperature_scale(0.5) == 2.0
    with pytest.raises(ValueError, match="temperature"):
        temperature_scale(-0.1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("chunk_elements", [1 << 24, 300])  # one chunk / one row per chunk
def test_single_rank_matches_log_softmax(temperature, chunk_elements):
    logits, target = make_inputs(0)
    logits.requires_grad_(True)
    logprobs, entropy = vocab_parallel_logprobs(logits, target, real_vocab_size=REAL_VOCAB, temperature=temperature,
                                                chunk_elements=chunk_elements)
    expected_logprobs, expected_entropy = reference(logits.detach(), target, REAL_VOCAB, temperature)
    torch.testing.assert_close(logprobs.double(), expected_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), expected_entropy, atol=1e-5, rtol=0)
    assert not entropy.requires_grad

    weights = torch.randn(target.shape, generator=torch.Generator().manual_seed(1))
    (logprobs * weights).sum().backward()
    reference_logits = logits.detach().clone().requires_grad_(True)
    expected, _ = reference(reference_logits, target, REAL_VOCAB, temperature)
    (expected * weights.double()).sum().backward()
    torch.testing.assert_close(logits.grad, reference_logits.grad.float(), atol=1e-6, rtol=1e-5)
    assert torch.all(logits.grad[..., REAL_VOCAB:] == 0)


def test_bf16_logits_are_computed_in_float32():
    logits, target = make_inputs(2)
    logprobs, _ = vocab_parallel_logprobs(logits.bfloat16(), target, real_vocab_size=REAL_VOCAB)
    expected, _ = reference(logits.bfloat16().float(), target, REAL_VOCAB, 1.0)
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=0)


def test_shape_mismatch_and_too_small_vocab_are_errors():
    logits, target = make_inputs(3)
    with pytest.raises(ValueError, match="target_ids of shape"):
        vocab_parallel_logprobs(logits, target[:, :-1], real_vocab_size=REAL_VOCAB)
    with pytest.raises(ValueError, match="real_vocab_size"):
        vocab_parallel_logprobs(logits[..., :64], target, real_vocab_size=REAL_VOCAB)


CASES = ((1.0, PADDED_VOCAB), (0.6, 128))  # padding on rank 1 only (256); real ids 64..100 + padding on rank 1 (128)


def tensor_parallel_job():
    """TP=2 over gloo: each rank holds its vocab slice; returns, per case, values and the gradient of its slice."""
    import torch.distributed as dist

    from dapo_megatron.policy.logprobs import vocab_parallel_logprobs

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for temperature, padded_vocab in CASES:
        logits, target = make_inputs(5)
        shard = padded_vocab // world
        local = logits[..., rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
        logprobs, entropy = vocab_parallel_logprobs(local, target, real_vocab_size=REAL_VOCAB,
                                                    temperature=temperature, tp_group=dist.group.WORLD,
                                                    tp_rank=rank, chunk_elements=200)
        weights = torch.randn(target.shape, generator=torch.Generator().manual_seed(1))
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach().numpy(), entropy.numpy(), local.grad.numpy()))
    return results


def test_tensor_parallel_matches_full_vocabulary():
    """TP=2: values, entropy and the gradient of each rank's slice equal the full-vocabulary reference."""
    per_rank = run_distributed(tensor_parallel_job, 2)
    for case, (temperature, padded_vocab) in enumerate(CASES):
        logits, target = make_inputs(5)
        logits = logits[..., :padded_vocab].clone().requires_grad_(True)
        expected_logprobs, expected_entropy = reference(logits, target, REAL_VOCAB, temperature)
        weights = torch.randn(target.shape, generator=torch.Generator().manual_seed(1))
        (expected_logprobs * weights.double()).sum().backward()
        shard = padded_vocab // 2
        for rank, results in enumerate(per_rank):
            logprobs, entropy, grad = (torch.from_numpy(array) for array in results[case])
            torch.testing.assert_close(logprobs.double(), expected_logprobs.detach(), atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy.double(), expected_entropy.detach(), atol=1e-5, rtol=0)
            torch.testing.assert_close(grad, logits.grad[..., rank * shard:(rank + 1) * shard].float(),
                                       atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- rows read in place (issue 26, item 2)


@pytest.mark.parametrize("chunk_elements", [1 << 24, 300])
def test_rows_are_read_in_place_with_the_values_and_gradient_of_a_gathered_copy(chunk_elements):
    logits, _ = make_inputs(6, rows=1, cols=40)
    logits = logits[0].clone().requires_grad_(True)  # [40 positions, vocab]
    rows = torch.tensor([3, 4, 5, 17, 18, 30, 31, 32, 33, 39, 18])  # position 18 twice: gradients add up
    target = torch.randint(0, REAL_VOCAB, rows.shape, generator=torch.Generator().manual_seed(2))
    (logprobs, entropy), saved = saved_during(lambda: vocab_parallel_logprobs(
        logits, target, rows=rows, real_vocab_size=REAL_VOCAB, temperature=0.7, chunk_elements=chunk_elements))
    assert logits_sized_copies(saved, logits) == []  # only the model's own logits are kept for backward

    gathered = logits.detach()[rows].clone().requires_grad_(True)  # the reference: what a gathered copy gives
    expected, expected_entropy = vocab_parallel_logprobs(gathered, target, real_vocab_size=REAL_VOCAB,
                                                         temperature=0.7, chunk_elements=chunk_elements)
    torch.testing.assert_close(logprobs, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-6, rtol=0)
    weights = torch.randn(rows.shape, generator=torch.Generator().manual_seed(3))
    (logprobs * weights).sum().backward()
    (expected * weights).sum().backward()
    scattered = torch.zeros_like(logits).index_add_(0, rows, gathered.grad)
    torch.testing.assert_close(logits.grad, scattered, atol=1e-6, rtol=1e-5)


def test_control_a_gathered_copy_is_what_the_check_above_catches():
    logits, target = make_inputs(7, rows=1, cols=40)
    logits = logits[0].clone().requires_grad_(True)
    rows = torch.arange(0, 40, 2)
    _, saved = saved_during(lambda: vocab_parallel_logprobs(logits[rows], target[0, rows], real_vocab_size=REAL_VOCAB))
    assert [tuple(t.shape) for t in logits_sized_copies(saved, logits)] == [(20, PADDED_VOCAB)]


def test_rows_need_matching_targets():
    logits, target = make_inputs(8, rows=1, cols=10)
    with pytest.raises(ValueError, match="with rows"):
        vocab_parallel_logprobs(logits[0], target[0, :3], rows=torch.arange(4), real_vocab_size=REAL_VOCAB)
