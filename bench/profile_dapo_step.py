"""Where dapo-megatron's step time goes on bench_vs_trl.py's workload, lead by lead (issue 15), CPU, one thread.

    python bench/profile_dapo_step.py                  # 8 prompts x 8 samples
    python bench/profile_dapo_step.py --batch-scale 4  # 32 prompts x 8 samples

Builds the benchmark's model, the policy (real megatron-core at TP=1, the CPU layer installed) and the embedded
engine in this process, samples one batch of the task's prompts and times each phase's work on its own (CPU time,
median of ``--reps``; CPU time does not count waiting for a core on a shared machine):

1. the phases as the trainer runs them and the CPU layer's redirect mode: torch calls it sees per phase (generation
   and packing run with it suspended), what one call costs with and without it;
2. micro-batch layouts for a forward-only pass and an update: the CPU path's packed "segments" rows of
   512/4096/16384 tokens (attention per sample, each prompt once), the dense block-diagonal masked square it
   replaced ("mask", 512-token rows), and right-padded rows; with the share of the forward spent in core attention;
3. the fixed cost of one micro-batch (megatron's per-layer Python work) and the planner's and optimizer's shares of
   an update;
4. the local spec's hand-written RMSNorm/SwiGLU/RoPE forward and backward (:mod:`dapo_megatron.cpu.layers`)
   against the same layers run op by op under autograd, as megatron's modules run them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from bench_vs_trl import bench_config


def cpu_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


@contextmanager
def counting_mode_calls(counter: list[int]):
    """Count the calls the installed redirect mode handles (one list cell, incremented per call)."""
    from dapo_megatron.overrides.megatron_core.cpu_compat import CudaToCpuMode

    real = CudaToCpuMode.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        counter[0] += 1
        return real(self, func, types, args, kwargs)

    CudaToCpuMode.__torch_function__ = counted
    try:
        yield
    finally:
        CudaToCpuMode.__torch_function__ = real


@contextmanager
def op_by_op_local_layers():
    """The local spec's RMSNorm, MLP and RoPE as megatron's modules compute them, op by op under autograd."""
    from megatron.core.transformer.mlp import MLP

    from dapo_megatron.cpu import attention as cpu_attention
    from dapo_megatron.cpu.layers import LocalRMSNorm, SwiGLUMLP

    def rotate(x, cos, sin):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    saved = LocalRMSNorm.forward, SwiGLUMLP.forward, cpu_attention._rotate
    LocalRMSNorm.forward, SwiGLUMLP.forward, cpu_attention._rotate = torch.nn.RMSNorm.forward, MLP.forward, rotate
    try:
        yield
    finally:
        LocalRMSNorm.forward, SwiGLUMLP.forward, cpu_attention._rotate = saved


@contextmanager
def cpu_time_of(objects_and_methods, totals: dict[str, float]):
    """Accumulate the CPU time of each ``(object, method name)`` into ``totals[name]`` while the block runs."""
    originals = []
    for obj, name in objects_and_methods:
        real = getattr(obj, name)

        def timed(*args, _real=real, _name=name, **kwargs):
            start = time.process_time()
            try:
                return _real(*args, **kwargs)
            finally:
                totals[_name] = totals.get(_name, 0.0) + time.process_time() - start

        originals.append((obj, name, real))
        setattr(obj, name, timed)
    try:
        yield
    finally:
        for obj, name, real in originals:
            setattr(obj, name, real)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-scale", type=int, default=1, help="prompts = 8 x this, 8 samples each")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from baseline_packing import MaskPacker, PaddedPacker
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from dapo_megatron.cpu.segment_packing import SegmentPacker
    from dapo_megatron.data.sampler import PromptSampler
    from dapo_megatron.handoff import gather_hf_buckets_to_rank0
    from dapo_megatron.overrides.megatron_core import cpu_compat
    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.algorithm import build_policy_loss
    from dapo_megatron.policy.actor import build_actor
    from dapo_megatron.policy.batch_plan import PackedBatching
    from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec
    from dapo_megatron.policy.packing import PolicySample, pack_micro_batches
    from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
    from dapo_megatron.rollout.engine import SamplingParams
    from dapo_megatron.tiny_model import prepare_tiny_model
    from dapo_megatron.run.model_source import load_tokenizer
    from dapo_megatron.data.task import train_prompts

    config = bench_config(args.seed)
    reps = args.reps
    with tempfile.TemporaryDirectory(prefix="profile_dapo_step_") as tmp:
        model_dir = prepare_tiny_model(config, Path(tmp) / "model")
        tokenizer = load_tokenizer(config, model_dir)
        records = PromptSampler(train_prompts(config, tokenizer), batch_size=8 * args.batch_scale,
                                seed=args.seed).next_batch()
        backend = init_distributed(1, 1).backend
        seed_everything(args.seed)
        spec = load_model_spec(model_dir)
        c = config
        actor = build_actor(spec, backend=backend, model=c.model, parallel=c.parallel, optim=c.optim,
                            routing_replay=c.algorithm.moe_routing_replay == "replay_old",
                            micro_batch_tokens=c.trainer.micro_batch_tokens,
                            temperature=c.rollout.temperature)
        load_hf_weights(actor.model, spec, model_dir)
        actor.optimizer.reload_model_params()
        loss = build_policy_loss(c.algorithm)
        engine = EmbeddedEngine.from_hf_directory(model_dir)

    prompts = [list(r.prompt_ids) for r in records]
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=32, stop_token_ids=(tokenizer.eos_token_id,),
                            seed=args.seed)
    groups = engine.generate(prompts, params)
    samples = [PolicySample(prompt_ids=torch.tensor(p), response_ids=torch.tensor(s.token_ids),
                            advantage=1.0 if i % 2 else -1.0)
               for p, group in zip(prompts, groups) for i, s in enumerate(group)]
    old = actor.compute_logprobs(samples).logprobs
    samples = [PolicySample(s.prompt_ids, s.response_ids, advantage=s.advantage, old_logprobs=o)
               for s, o in zip(samples, old)]
    budget = config.trainer.micro_batch_tokens
    real_tokens = sum(s.length for s in samples)
    padded_tokens = len(samples) * max(s.length for s in samples)
    print(f"batch: {len(prompts)} prompts x 8 = {len(samples)} samples, {real_tokens} tokens "
          f"({sum(s.response_length for s in samples)} generated); one right-padded micro-batch would hold "
          f"{padded_tokens}; trainer.micro_batch_tokens = {budget}; {reps} reps, CPU ms")

    def hand_off():
        engine.update_weights(gather_hf_buckets_to_rank0(actor.model, spec, tp_gather=backend.tp_gather), version=1)

    phases = {"gen": lambda: engine.generate(prompts, params), "forward-only": lambda: actor.compute_logprobs(samples),
              "update": lambda: actor.train_minibatch(samples, loss), "handoff": hand_off}
    print("\n1. phases now, and the redirect mode's calls in each")
    for name, fn in phases.items():
        counter = [0]
        with counting_mode_calls(counter):
            fn()
        print(f"  {name:<12}{cpu_ms(fn, reps):8.1f} ms  {counter[0]:7d} mode calls")
    a, b = torch.ones(4), torch.ones(4)

    def adds():
        for _ in range(20000):
            torch.add(a, b)

    with_mode = cpu_ms(adds, reps) / 20
    with cpu_compat.suspended():
        without = cpu_ms(adds, reps) / 20
    print(f"  one torch.add: {with_mode:.2f} us with the mode, {without:.2f} us without "
          f"({with_mode - without:.2f} us per call)")

    print("\n2. micro-batch layouts (forward-only pass, update; share of the forward in core attention)")
    attention = [0.0]

    def before(module, inputs):
        module.profile_start = time.process_time()

    def after(module, inputs, output):
        attention[0] += time.process_time() - module.profile_start

    hooks = [hook for m in actor.model.modules() if isinstance(m, DotProductAttention)
             for hook in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    layouts = [(f"segments {n} tokens/row", SegmentPacker(), PackedBatching(token_budget=n))
               for n in (512, 4096, 16384)]
    layouts += [("mask 512 tokens/row", MaskPacker(), PackedBatching(token_budget=512))]
    layouts += [(f"padded {n} samples/mb", PaddedPacker(samples_per_micro_batch=n), PackedBatching(token_budget=1))
                for n in sorted({1, 64, len(samples)}) if n <= len(samples)]
    per_micro_batch = {}
    for label, packer, batching in layouts:
        backend.packer = packer
        count = len(pack_micro_batches(samples, packer, token_budget=batching.token_budget))
        attention[0] = 0.0
        start = time.process_time()
        actor.compute_logprobs(samples, batching=batching)
        share = attention[0] / (time.process_time() - start)
        forward = cpu_ms(lambda: actor.compute_logprobs(samples, batching=batching), reps)
        update = cpu_ms(lambda: actor.train_minibatch(samples, loss, batching=batching), reps)
        per_micro_batch[label] = (count, forward, update)
        print(f"  {label:<24}{count:4d} micro-batches  forward {forward:7.1f}  update {update:7.1f}  "
              f"attention {share:4.0%} of the forward")
    backend.packer = SegmentPacker()
    for hook in hooks:
        hook.remove()

    one, _, _ = per_micro_batch["padded 1 samples/mb"]
    full = per_micro_batch[f"padded {len(samples)} samples/mb"]
    single = per_micro_batch["padded 1 samples/mb"]
    print(f"\n3. fixed cost of one micro-batch (padded 1/mb vs all in one): "
          f"forward {(single[1] - full[1]) / (one - 1):.2f} ms, "
          f"forward+backward {(single[2] - full[2]) / (one - 1):.2f} ms")
    totals: dict[str, float] = {}
    optimizer_methods = [(actor.optimizer, name) for name in ("prepare_grads", "get_grad_norm", "step")]
    with cpu_time_of(optimizer_methods + [(actor, "_plan")], totals):
        update = cpu_ms(phases["update"], reps)
    print(f"  update {update:.1f} ms, of which (per update) " + ", ".join(
        f"{name} {seconds / reps * 1e3:.1f} ms" for name, seconds in totals.items()))

    print("\n4. the local spec's hand-written RMSNorm, SwiGLU and RoPE against the same layers op by op under autograd")
    for label, context in (("hand-written", nullcontext), ("op by op", op_by_op_local_layers),
                           ("hand-written", nullcontext), ("op by op", op_by_op_local_layers)):
        with context():
            forward = cpu_ms(phases["forward-only"], reps)
            update = cpu_ms(phases["update"], reps)
        print(f"  {label:<14}forward {forward:7.1f}  update {update:7.1f}")


if __name__ == "__main__":
    main()
