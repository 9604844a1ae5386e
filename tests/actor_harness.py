"""Shared pieces of the policy-actor tests: a tiny HF checkpoint, random samples, an actor built from the checkpoint
at any TP/PP/DP layout, and the full HF-named weights gathered back from it.

Functions that build actors run inside ranks spawned by :func:`spawn_ranks.run_distributed`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dapo_megatron.policy.packing import PolicySample

TINY_VOCAB = 101  # padded to 256 at TP=2: TP rank 1 holds only padding rows


def write_tiny_qwen2(directory: str | Path, *, num_layers: int = 4, seed: int = 0) -> Path:
    """A random fp32 Qwen2 (GQA 6 heads / 2 KV groups, QKV bias, SwiGLU, RMSNorm, RoPE) saved as safetensors."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    config = Qwen2Config(
        vocab_size=TINY_VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # biases and norms start at 0 / 1 in HF: perturb them so a wrong mapping shows
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def random_samples(count: int, *, seed: int, prompt_lengths=(2, 8), response_lengths=(2, 20),
                   vocab_size: int = TINY_VOCAB) -> list[PolicySample]:
    """Samples with random ids, alternating ±1 advantages and random old log-probs near the policy's (≈ −4.6)."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        prompt = int(torch.randint(*prompt_lengths, (1,), generator=generator))
        response = int(torch.randint(*response_lengths, (1,), generator=generator))
        samples.append(PolicySample(
            prompt_ids=torch.randint(0, vocab_size, (prompt,), generator=generator),
            response_ids=torch.randint(0, vocab_size, (response,), generator=generator),
            advantage=1.0 if i % 2 == 0 else -1.0,
            old_logprobs=-4.6 + 0.3 * torch.randn(response, generator=generator),
        ))
    return samples


def actor_settings(**overrides) -> dict:
    """:func:`build_actor`'s keyword arguments for the tests: fp32, the plain optimizer, no routing replay, the
    schema's defaults otherwise."""
    from dapo_megatron.config import ModelConfig, OptimConfig, ParallelConfig

    settings = dict(model=ModelConfig(precision="fp32"), parallel=ParallelConfig(use_distributed_optimizer=False),
                    optim=OptimConfig(), routing_replay=False, micro_batch_tokens=4096, temperature=1.0)
    return {**settings, **overrides}


def loss_of(**algorithm):
    """The policy loss the trainer builds from an ``algorithm`` section with these settings, without the dual clip
    unless given (the tests' reference computations use the plain clipped loss)."""
    from dapo_megatron.algorithm import build_policy_loss
    from dapo_megatron.config import AlgorithmConfig

    return build_policy_loss(AlgorithmConfig(**{"clip_ratio_c": None, **algorithm}))


def build_test_actor(hf_dir: str | Path, tensor_parallel: int, pipeline_parallel: int, settings: dict,
                     seed: int = 0, expert_parallel: int = 1, recompute: str | None = None):
    """Initialize this rank's TP/PP(/EP) layout and build the actor from ``settings`` (:func:`actor_settings`) with
    the HF weights loaded, the way the trainer does. ``recompute``: the activation recomputation to build with where
    the backend would choose none (the CPU backend never recomputes; a test of what recomputation changes needs
    it)."""
    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.policy.actor import build_actor
    from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec

    backend = init_distributed(tensor_parallel, pipeline_parallel, expert_parallel=expert_parallel).backend
    if recompute is not None:
        backend = _recomputing(backend, recompute)
    seed_everything(seed)
    spec = load_model_spec(hf_dir)
    actor = build_actor(spec, backend=backend, **settings)
    load_hf_weights(actor.model, spec, hf_dir)
    actor.optimizer.reload_model_params()
    return actor, spec


def _recomputing(backend, recompute: str):
    class Recomputing(type(backend)):
        def recompute(self, requested):
            return recompute

    return Recomputing()


def gather_hf_weights(actor, spec) -> dict[str, torch.Tensor] | None:
    """Full HF-named tensors on global rank 0 (None elsewhere); every rank must call it."""
    import torch.distributed as dist

    from dapo_megatron.handoff.exporter import gather_hf_buckets_to_rank0

    weights = {}
    for bucket in gather_hf_buckets_to_rank0(actor.model, spec, tp_gather=actor.backend.tp_gather):
        weights.update({name: tensor.detach().clone().cpu() for name, tensor in bucket})
    return weights if dist.get_rank() == 0 else None


def logprobs_and_gradients(actor, samples, weights, batching, temperature: float) -> dict:
    """Per-sample response log-probs of ``samples`` laid out by the actor's current packer and ``batching``, and this
    rank's parameter gradients of Σ_i Σ_t weights[i][t]·log p (every micro-batch's forward and backward by hand)."""
    plan = actor.plan(samples, batching)
    actor.model.zero_grad_buffer()
    logprobs = [None] * len(samples)
    for mb in plan.micro_batches:
        logits = actor.model(mb.tokens, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params)
        rows, _ = actor.response_logprobs(mb, logits, temperature=temperature)
        loss = logits.sum() * 0.0
        for row, index in enumerate(mb.sample_indices):
            length = samples[index].response_length
            logprobs[index] = rows[row, :length].detach()
            loss = loss + (rows[row, :length] * weights[index]).sum()
        loss.backward()
    return dict(logprobs=logprobs, micro_batches=plan.micro_batches,
                grads={name: param.main_grad.clone() for name, param in actor.model.named_parameters()})
