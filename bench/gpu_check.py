"""The GPU check for a lent H200 (``scripts/gpu_check.sh``): the policy side of a paper-scale run, in one table.

    python bench/gpu_check.py [--tiny] [--json FILE]

One process, a world of one (TP = PP = DP = 1: one GPU cannot host an NCCL group of two), BF16 parameters with FP32
main parameters and gradients and the distributed optimizer, as ``build_actor`` makes them for a run, on the layers
``model.kernels: auto`` picks here (Transformer Engine's when importable, else megatron-core's local spec with torch
SDPA; the lent H200 has no Transformer Engine). Every row names that layer path (the backend, ``[cuda+local_sdpa]``
...): a real run on a machine with Transformer Engine trains on TE's layers, so an MFU of the local spec is not its
MFU. Where Transformer Engine is importable the MFU rows time both paths (:func:`mfu_kernels`). Rows:

1. ``bf16 matmul`` — a square bf16 GEMM, for the peak this device reaches (context for the MFU rows);
2. ``logprob parity bf16 vs fp32`` — the actor's forward-only log-probs of random samples through a
   Qwen2.5-0.5B-shaped random model with fewer layers, BF16 against an FP32 copy of the same weights: mean/max
   absolute difference;
3. ``DAPO updates (bf16)`` — updates through ``Actor.train_minibatch`` with the DAPO loss: every gradient norm
   finite, no update skipped, the weights changed;
4. ``weight handoff`` — the exporter (``gather_hf_buckets_to_rank0``, bf16 buckets) into the embedded engine's
   weight loader (``load_named_tensors``) on an HF Qwen2 model on the same device, in GB/s of weights delivered,
   next to a device-to-device copy (``Tensor.copy_``, bytes copied per second) in the same run;
5. ``engine vs policy logprob gap (bf16)`` — that HF model's teacher-forced log-probs of the same samples against
   the BF16 actor's: what the rollout-correction metrics would see from numerics alone (the embedded engine's
   decode loop itself runs on CPU only, so it is not what runs here);
6. ``colocated turn`` and 7. ``colocated MoE turn`` — the trainer's side of a generation turn under
   ``rollout.placement: colocated``, dense and Qwen3-MoE (:mod:`gpu_check_colocated` says what each measures). The
   SGLang side (release/resume with the memory saver, CUDA IPC into resumed weights) needs SGLang on the GPU machine,
   which this check does not have;
   ``routing replay with full recomputation`` — a replayed MoE update with and without ``model.recompute: full``,
   what megatron's replay queue holds on the GPU, host syncs in the replay's code (:mod:`gpu_check_routing`);
   ``SGLang on this GPU`` — R3 routing end to end, samples in flight, by-value payload entries against a real server
   where SGLang is installed, else skipped with the reason (:mod:`gpu_check_sglang`);
8. ``training MFU`` — per layer path, tokens/s of DAPO updates on packed micro-batches of a realistic token budget
   for Qwen2.5-0.5B- and 1.5B-shaped random models, and MFU = model FLOP/s ÷ the H200's dense BF16 spec
   (989 TFLOP/s; row 1 gives the measured GEMM peak to compare with). Model FLOPs = 6 · N · tokens (N = the
   GEMM parameters: every layer's linear weights and the LM head) + causal attention 6 · layers · q_width · Σ s²
   over the packed samples (QK^T and PV, forward + backward); the recomputation the actor does is not counted.

``--tiny`` runs the same code on CPU with tiny shapes in seconds (the test-suite runs it): its numbers only show
that every row computes; the MFU there is still divided by the H200 peak.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_setup import FULL, TINY, CheckShapes, Row, dapo_loss, random_samples, sync  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0


def _timed(fn, repeats: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs, after one untimed warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _spec(shape: dict):
    """The HF config of a published shape with the given changes (``name`` picks the shape)."""
    from dapo_megatron.policy.shapes import published_hf_config

    arguments = dict(shape)
    return published_hf_config(arguments.pop("name"), **arguments)


def mfu_kernels(cuda_available: bool, transformer_engine: bool) -> tuple[str, ...]:
    """The ``model.kernels`` the MFU rows time: both CUDA layer paths where Transformer Engine is importable (TE's is
    what a run uses there), the local spec where it is not, the CPU's layers without CUDA."""
    if not cuda_available:
        return ("auto",)
    return ("transformer_engine", "local") if transformer_engine else ("local",)


def build_check_actor(spec, precision: str, token_budget: int, hf_dir: Path | None = None, lr: float = 1e-4,
                      kernels: str = "auto"):
    """The actor a run builds (``build_actor``) at this precision, with the distributed optimizer, on the backend
    ``model.kernels`` selects here."""
    from dapo_megatron.backend_registry import select_backend
    from dapo_megatron.config import ModelConfig, OptimConfig, ParallelConfig
    from dapo_megatron.policy.actor import build_actor
    from dapo_megatron.policy.hf_loader import load_hf_weights

    actor = build_actor(spec, backend=select_backend(kernels),
                        model=ModelConfig(precision=precision, kernels=kernels), parallel=ParallelConfig(),
                        optim=OptimConfig(lr=lr, warmup_steps=0), routing_replay=False,
                        micro_batch_tokens=token_budget, temperature=1.0)
    if hf_dir is not None:
        load_hf_weights(actor.model, spec, hf_dir)
        actor.optimizer.reload_model_params()
    return actor


def _abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float, int]:
    diff = torch.cat([(x.float() - y.float()).abs() for x, y in zip(a, b)])
    return float(diff.mean()), float(diff.max()), diff.numel()


def matmul_row(shapes: CheckShapes, device: torch.device) -> Row:
    n = shapes.matmul_size
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = _timed(lambda: a @ b, shapes.repeats)
    tflops = 2 * n**3 / seconds / 1e12
    return Row("bf16 matmul", f"{tflops:.3g} TFLOP/s", f"{n}x{n}x{n}, median of {shapes.repeats}",
               {"tflops": tflops})


def parity_and_updates(shapes: CheckShapes, workdir: Path, device: torch.device) -> tuple[list[Row], object, object]:
    """Rows 2 and 3; returns them, the BF16 actor and the spec (for the handoff rows)."""
    from transformers import AutoModelForCausalLM

    from dapo_megatron.policy.model_spec import model_spec_from_hf
    from dapo_megatron.policy.packing import PolicySample

    hf_config = _spec(shapes.parity_model)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(workdir / "hf")
    spec = model_spec_from_hf(hf_config)
    samples = random_samples(shapes.samples, spec.vocab_size, shapes.prompt_tokens, shapes.response_tokens, seed=1)
    budget = max(s.length for s in samples) * 2

    reference = build_check_actor(spec, "fp32", budget, workdir / "hf")
    ref_logprobs = reference.compute_logprobs(samples).logprobs
    del reference
    actor = build_check_actor(spec, "bf16", budget, workdir / "hf")
    logprobs = actor.compute_logprobs(samples).logprobs
    mean, worst, tokens = _abs_diff(logprobs, ref_logprobs)
    path = actor.backend.name
    rows = [Row(f"logprob parity bf16 vs fp32 ({spec.num_layers}-layer {shapes.parity_model['name']}-shaped) [{path}]",
                f"mean abs diff {mean:.3g}, max {worst:.3g}", f"{len(samples)} samples, {tokens} response tokens",
                {"mean_abs": mean, "max_abs": worst})]

    train = [PolicySample(s.prompt_ids, s.response_ids, s.advantage, old_logprobs=lp)
             for s, lp in zip(samples, logprobs)]
    before = [p.detach().clone() for p in actor.model.parameters()]
    updates = [actor.train_minibatch(train, dapo_loss()) for _ in range(3)]
    changed = max(float((p.detach().float() - b.float()).abs().max()) for p, b in zip(actor.model.parameters(), before))
    norms = [u["grad_norm"] for u in updates]
    skipped = sum(u["skipped"] for u in updates)
    ok = all(math.isfinite(n) for n in norms) and skipped == 0 and changed > 0
    rows.append(Row(f"DAPO updates (bf16, distributed optimizer) [{path}]", "ok" if ok else "FAILED",
                    f"grad norms {', '.join(f'{n:.4g}' for n in norms)}; skipped {skipped:g}; "
                    f"max abs weight change {changed:.3g}",
                    {"grad_norm_last": norms[-1], "skipped": skipped, "max_weight_change": changed}))
    return rows, actor, spec


def handoff_rows(shapes: CheckShapes, actor, spec, samples_seed: int, device: torch.device) -> list[Row]:
    """Rows 4 and 5: the exporter into the embedded engine's loader on an HF model here, and the log-prob gap."""
    from transformers import AutoModelForCausalLM

    from dapo_megatron.handoff import gather_hf_buckets_to_rank0
    from dapo_megatron.hf_format import nbytes
    from dapo_megatron.rollout.embedded.engine import load_named_tensors

    engine_model = AutoModelForCausalLM.from_config(_spec(shapes.parity_model), dtype=torch.bfloat16,
                                                    attn_implementation="sdpa")
    engine_model = engine_model.to(device).eval().requires_grad_(False)
    delivered = [0]

    def stream():
        for bucket in gather_hf_buckets_to_rank0(actor.model, spec, dtype=torch.bfloat16,
                                                 tp_gather=actor.backend.tp_gather):
            delivered[0] += sum(nbytes(t) for _, t in bucket)
            yield from bucket

    def handoff():
        delivered[0] = 0
        load_named_tensors(engine_model, stream())

    seconds = _timed(handoff, shapes.repeats)
    handoff_gbps = delivered[0] / seconds / 1e9
    source = torch.empty(shapes.copy_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_gbps = shapes.copy_bytes / _timed(lambda: target.copy_(source), shapes.repeats) / 1e9
    rows = [Row("weight handoff -> embedded engine loader", f"{handoff_gbps:.3g} GB/s",
                f"{delivered[0] / 1e9:.3g} GB bf16 in {seconds * 1e3:.3g} ms; device copy {copy_gbps:.3g} GB/s "
                f"(bytes copied/s, read+write is twice that)",
                {"handoff_gbps": handoff_gbps, "copy_gbps": copy_gbps})]

    samples = random_samples(shapes.samples, spec.vocab_size, shapes.prompt_tokens, shapes.response_tokens,
                             seed=samples_seed)
    policy = actor.compute_logprobs(samples).logprobs
    engine = []
    with torch.inference_mode():
        for s in samples:
            tokens = torch.cat([s.prompt_ids, s.response_ids])[None].to(device)
            logp = torch.log_softmax(engine_model(input_ids=tokens).logits[0].float(), dim=-1)
            engine.append(logp[s.prompt_length - 1:-1].gather(-1, tokens[0, s.prompt_length:, None])[:, 0].cpu())
    mean, worst, tokens = _abs_diff(engine, policy)
    rows.append(Row("engine vs policy logprob gap (bf16)", f"mean abs diff {mean:.3g}, max {worst:.3g}",
                    f"HF Qwen2 (sdpa) teacher-forced vs megatron actor; {tokens} tokens",
                    {"mean_abs": mean, "max_abs": worst}))
    return rows


def model_flops(spec, segment_lengths: list[int]) -> float:
    """6 · N · tokens + causal attention 6 · layers · q_width · Σ s² (see the module docstring)."""
    q, k, h = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size
    gemm_params = spec.num_layers * ((q + 2 * k) * h + q * h + 3 * spec.ffn_hidden_size * h) + spec.vocab_size * h
    return 6 * gemm_params * sum(segment_lengths) + 6 * spec.num_layers * q * sum(s * s for s in segment_lengths)


def mfu_row(shapes: CheckShapes, label: str, shape: dict, peak_tflops: float, kernels: str = "auto") -> Row:
    from dapo_megatron.policy.model_spec import model_spec_from_hf
    from dapo_megatron.policy.packing import PolicySample

    spec = model_spec_from_hf(_spec(shape))
    generator = torch.Generator().manual_seed(7)
    # Realistic DAPO samples: short prompts, long responses; enough of them to fill rows_per_update packed rows.
    low, high = shapes.token_budget // 16, shapes.token_budget // 2
    samples, total = [], 0
    while total < shapes.rows_per_update * shapes.token_budget * 0.9:
        length = int(torch.randint(low, high + 1, (1,), generator=generator))
        prompt = max(1, length // 8)
        ids = torch.randint(0, spec.vocab_size, (length,), generator=generator)
        samples.append(PolicySample(ids[:prompt], ids[prompt:], advantage=1.0 if len(samples) % 2 else -1.0,
                                    old_logprobs=torch.full((length - prompt,), -12.0)))
        total += length
    actor = build_check_actor(spec, "bf16", shapes.token_budget, lr=1e-6, kernels=kernels)
    path = actor.backend.name
    metrics = []
    seconds = _timed(lambda: metrics.append(actor.train_minibatch(samples, dapo_loss())), shapes.timed_updates)
    tokens = sum(s.length for s in samples)
    flops = model_flops(spec, [s.length for s in samples])
    achieved = flops / seconds / 1e12
    actor = None  # its memory goes back before the next row is built
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return Row(f"training MFU {label} [{path}]", f"{achieved / peak_tflops * 100:.3g} % MFU",
               f"{tokens / seconds:,.0f} tokens/s, {achieved:.3g} TFLOP/s of {peak_tflops:g}; {tokens} tokens in "
               f"{metrics[-1]['num_micro_batches']:g} micro-batches of <= {shapes.token_budget}; layers: {path}",
               {"mfu": achieved / peak_tflops, "tokens_per_s": tokens / seconds, "tflops": achieved})


def format_table(rows: list[Row], header: str) -> str:
    widths = [max(len(r.check) for r in rows), max(len(r.value) for r in rows)]
    lines = [header, f"| {'check':<{widths[0]}} | {'result':<{widths[1]}} | detail |",
             f"|{'-' * (widths[0] + 2)}|{'-' * (widths[1] + 2)}|--------|"]
    lines += [f"| {r.check:<{widths[0]}} | {r.value:<{widths[1]}} | {r.detail} |" for r in rows]
    return "\n".join(lines)


def run_check(shapes: CheckShapes) -> list[Row]:
    from gpu_check_colocated import colocated_moe_row, colocated_row
    from gpu_check_routing import replay_recompute_row
    from gpu_check_sglang import sglang_row

    from dapo_megatron.backend_registry import transformer_engine_importable
    from dapo_megatron.platform import destroy_distributed, init_distributed, seed_everything

    layout = init_distributed(1, 1)
    seed_everything(0)
    device = layout.device.device
    try:
        rows = [matmul_row(shapes, device)]
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            parity, actor, spec = parity_and_updates(shapes, Path(tmp), device)
            rows += parity
            rows += handoff_rows(shapes, actor, spec, samples_seed=2, device=device)
            rows.append(colocated_row(shapes, actor, spec, device))
            del actor
        rows.append(colocated_moe_row(shapes, device))
        rows.append(replay_recompute_row(shapes, device))
        rows.append(sglang_row(shapes, device))
        kernels = mfu_kernels(torch.cuda.is_available(), transformer_engine_importable())
        for label, shape in shapes.mfu_models:
            rows += [mfu_row(shapes, label, shape, H200_BF16_DENSE_TFLOPS, path) for path in kernels]
    finally:
        destroy_distributed()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, on CPU when there is no GPU (seconds)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = run_check(TINY if args.tiny else FULL)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA)"
    header = (f"GPU check{' --tiny' if args.tiny else ''} on {device}, torch {torch.__version__}; MFU against the "
              f"H200 dense BF16 spec {H200_BF16_DENSE_TFLOPS:g} TFLOP/s; {time.perf_counter() - start:.0f} s")
    print(format_table(rows, header), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=2) + "\n")
    return 0 if all(r.value != "FAILED" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
