"""Training throughput of packed vs padded micro-batches on one mini-batch whose response lengths vary 10×.

One process (TP=1, PP=1, DP=1) builds a small random policy and runs :meth:`Actor.train_minibatch` on the same
samples with both batchings, alternating packed and padded steps so that machine load hits both alike. Reported per
batching: packing efficiency (real tokens / processed tokens), micro-batches per step, step times and real
training tokens per second — per wall-clock second of the best step, and per CPU second of this process (the CPU
time a step consumes is what a loaded shared machine distorts least); then the packed/padded ratios.

    python bench/bench_packing.py [--samples 32] [--min-response 20] [--max-response 200] [--steps 3]

Measured here (shared 2-core machine under heavy load, 1 thread, 32 samples, responses 20..200 tokens, 4555 real
tokens, hidden 128, 4 layers, the CPU "segments" layout): packing efficiency 1.000 packed vs 0.680 padded (x1.47);
training tokens per CPU-second packed/padded x1.77 at a 512-token budget (9 vs 8 micro-batches) and x1.25-1.32 at
4096 (2 micro-batches; on this shape, with a 2048-token vocabulary, longer rows are not faster). Wall-clock ratios
on the loaded machine are not trustworthy.

Notes on what it measures: on CPU the model's core attention
(:class:`dapo_megatron.cpu.attention.PackedSequenceAttention`) attends per sample inside a packed row, so
packing saves the padded tokens' work in every layer without paying attention across the samples of a row (before
it, a packed row was one dense masked ``S x S`` square and the ratio was x1.03). With Transformer Engine (THD,
``cu_seqlens``) attention is per sample too; that path needs a GPU and is not measured here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build_samples(args) -> list:
    from dapo_megatron.policy.packing import PolicySample

    """Response lengths evenly spread over [min, max] (so they vary exactly max/min ×), in shuffled order."""
    generator = torch.Generator().manual_seed(args.seed)
    spread = torch.linspace(args.min_response, args.max_response, args.samples).round().long()
    response_lengths = spread[torch.randperm(args.samples, generator=generator)].tolist()
    samples = []
    for i, response in enumerate(response_lengths):
        prompt = int(torch.randint(args.min_prompt, args.max_prompt + 1, (1,), generator=generator))
        samples.append(PolicySample(
            prompt_ids=torch.randint(0, args.vocab, (prompt,), generator=generator),
            response_ids=torch.randint(0, args.vocab, (response,), generator=generator),
            advantage=1.0 if i % 2 else -1.0,
            old_logprobs=torch.full((response,), -float(torch.log(torch.tensor(float(args.vocab))))),
        ))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=48)
    parser.add_argument("--min-response", type=int, default=20)
    parser.add_argument("--max-response", type=int, default=200)
    parser.add_argument("--token-budget", type=int, default=512, help="packed: tokens per micro-batch")
    parser.add_argument("--samples-per-micro-batch", type=int, default=4, help="padded: rows per micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per batching (after one warm-up each)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from baseline_packing import PaddedPacker

    from dapo_megatron.algorithm import build_policy_loss
    from dapo_megatron.config import AlgorithmConfig, ModelConfig, OptimConfig, ParallelConfig
    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.policy.actor import build_actor
    from dapo_megatron.policy.batch_plan import PackedBatching, plan_data_parallel
    from dapo_megatron.policy.model_spec import ModelSpec

    backend = init_distributed(1, 1).backend
    seed_everything(args.seed)
    heads = max(2, args.hidden // 32)
    spec = ModelSpec(arch="qwen2", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                     num_attention_heads=heads, num_kv_heads=heads // 2, head_dim=args.hidden // heads,
                     ffn_hidden_size=3 * args.hidden, rms_norm_eps=1e-6, rope_theta=10000.0, qkv_bias=True,
                     tie_embeddings=False, max_position_embeddings=4096)
    packers = {"packed": backend.packer, "padded": PaddedPacker(samples_per_micro_batch=args.samples_per_micro_batch)}
    batching = PackedBatching(token_budget=args.token_budget)
    actor = build_actor(spec, backend=backend, model=ModelConfig(precision="fp32"),
                        parallel=ParallelConfig(use_distributed_optimizer=False),
                        optim=OptimConfig(lr=1e-5, warmup_steps=0), routing_replay=False,
                        micro_batch_tokens=args.token_budget, temperature=1.0)
    loss = build_policy_loss(AlgorithmConfig(clip_ratio_c=None))
    samples = build_samples(args)
    lengths = [s.response_length for s in samples]
    real_tokens = sum(s.length for s in samples)
    print(f"{len(samples)} samples, response lengths {min(lengths)}..{max(lengths)} "
          f"({max(lengths) / min(lengths):.1f}x), {real_tokens} real tokens; model hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}; the {backend.name} backend's {type(backend.packer).__name__}")

    plans = {name: plan_data_parallel(samples, batching, packer, data_parallel=1, data_parallel_rank=0)
             for name, packer in packers.items()}
    times: dict[str, list[float]] = {name: [] for name in packers}
    cpu_times: dict[str, list[float]] = {name: [] for name in packers}
    for step in range(args.steps + 1):  # step 0 warms up both
        for name, packer in packers.items():
            backend.packer = packer
            start, cpu_start = time.perf_counter(), time.process_time()
            metrics = actor.train_minibatch(samples, loss, batching=batching)
            elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
            if metrics["skipped"]:
                raise RuntimeError(f"{name} step {step} was skipped (non-finite loss or gradient norm)")
            if step > 0:
                times[name].append(elapsed)
                cpu_times[name].append(cpu_elapsed)

    results = {}
    print(f"{'batching':<8} {'efficiency':>10} {'micro-batches':>13} {'processed tok':>13} {'best s':>8} "
          f"{'median s':>8} {'tok/s':>8} {'CPU s':>8} {'tok/CPU-s':>9}")
    for name, plan in plans.items():
        best, median, cpu = min(times[name]), statistics.median(times[name]), statistics.median(cpu_times[name])
        processed = sum(mb.num_processed_tokens for mb in plan.micro_batches)
        results[name] = dict(efficiency=plan.efficiency, tokens_per_s=real_tokens / best,
                             tokens_per_cpu_s=real_tokens / cpu)
        print(f"{name:<8} {plan.efficiency:>10.3f} {len(plan.micro_batches):>13d} {processed:>13d} {best:>8.3f} "
              f"{median:>8.3f} {real_tokens / best:>8.0f} {cpu:>8.3f} {real_tokens / cpu:>9.0f}")
    packed, padded = results["packed"], results["padded"]
    print(f"packed/padded: efficiency x{packed['efficiency'] / padded['efficiency']:.2f}, "
          f"tokens/s x{packed['tokens_per_s'] / padded['tokens_per_s']:.2f}, "
          f"tokens/CPU-s x{packed['tokens_per_cpu_s'] / padded['tokens_per_cpu_s']:.2f}")


if __name__ == "__main__":
    main()
