"""``dapo-megatron plan``: the training ranks' GPU memory per pipeline stage for a config
(:mod:`dapo_megatron.policy.memory`), then what shares its GPUs (colocated servers:
:mod:`dapo_megatron.rollout.gpu_sharing`) and routing replay's host memory; exit 1 when something does not fit."""

from __future__ import annotations

import argparse

from dapo_megatron.config import ConfigError, DAPOConfig
from dapo_megatron.policy.lora_memory import with_lora
from dapo_megatron.policy.lora_sizes import adapter_sizes
from dapo_megatron.policy.memory import memory_table, plan_stages
from dapo_megatron.policy.model_spec import ModelSpec
from dapo_megatron.policy.moe_routing import recorded_routing_bytes
from dapo_megatron.policy.rollout_routing import rollout_routing_bytes
from dapo_megatron.rollout.gpu_sharing import sharing_report
from dapo_megatron.run.model_source import model_spec_for_plan


def run(args: argparse.Namespace, config: DAPOConfig) -> int:
    spec, origin = model_spec_for_plan(config)
    gpu_memory_gb = args.gpu_memory_gb or config.parallel.gpu_memory_gb or 80.0
    report, fits = plan_report(config, spec, origin, data_parallel=args.data_parallel,
                               gpu_memory_gb=gpu_memory_gb, local_spec=args.local_spec)
    print(report)
    return 0 if fits else 1


def plan_report(config: DAPOConfig, spec: ModelSpec, origin: str, *, data_parallel: int | None = None,
                gpu_memory_gb: float = 80.0, local_spec: bool = False) -> tuple[str, bool]:
    """``dapo-megatron plan``: (the printed report, whether every stage fits ``gpu_memory_gb``) for ``config``'s
    layout of ``spec``, whose shape came from ``origin``.

    The layout is the config's: TP and PP, DP from ``parallel.data`` (or ``data_parallel``), the distributed optimizer,
    ``trainer.micro_batch_tokens``, ``model.precision`` and ``model.recompute``. It plans for the GPU production path,
    the Transformer Engine layer spec (fused attention, sequence parallelism as :func:`sequence_parallel_enabled`
    decides it); ``local_spec=True`` plans megatron's local spec instead (unfused attention, no sequence parallelism).
    """
    p = config.parallel
    dp = data_parallel or p.data or 1
    if dp % p.expert:
        source = "--data-parallel" if data_parallel else "parallel.data" if p.data else "DP 1, parallel.data unset"
        raise ConfigError(f"parallel.expert: {p.expert} expert-parallel ranks must divide the data-parallel size, "
                          f"{dp} ({source})")
    stages, sequence_parallel = plan_stages(config, spec, data_parallel=dp, local_spec=local_spec)
    lora = config.model.lora
    if lora.enabled:  # the base frozen, the adapters trained (policy/lora_memory.py)
        stages = with_lora(stages, spec, lora, tensor_parallel=p.tensor, data_parallel=dp, expert_parallel=p.expert,
                           precision=config.model.precision, distributed_optimizer=p.use_distributed_optimizer,
                           micro_batch_tokens=config.trainer.micro_batch_tokens, transformer_engine=not local_spec)
    routing = routing_replay_line(config, spec, stages, data_parallel=dp)
    sharing, sharing_fits = sharing_report(config, spec, stages, data_parallel=dp, gpu_memory_gb=gpu_memory_gb)
    fits = all(stage.total_bytes <= gpu_memory_gb * 1e9 for stage in stages) and sharing_fits
    lines = [
        f"model: {spec.arch}, {spec.num_layers} layers, hidden {spec.hidden_size}, vocab {spec.vocab_size}"
        + (f", {spec.moe.num_experts} experts (top {spec.moe.topk})" if spec.moe is not None else "") + f" ({origin})",
        f"layout: TP {p.tensor} x PP {p.pipeline} x DP {dp}" + (f" (EP {p.expert})" if spec.moe is not None else "")
        + ("" if data_parallel or p.data else " (parallel.data unset: DP 1 assumed, the largest optimizer share)")
        + f", {'distributed' if p.use_distributed_optimizer else 'replicated'} optimizer, {config.model.precision}",
        f"per micro-batch: {config.trainer.micro_batch_tokens} tokens; recompute: {config.model.recompute}; "
        f"sequence parallel: {'on' if sequence_parallel else 'off'}; attention: "
        f"{'megatron local spec (unfused)' if local_spec else 'Transformer Engine (fused)'}",
        *([lora_line(config, spec)] if lora.enabled else []),
        "",
        memory_table(stages, gpu_memory_gb=gpu_memory_gb),
        *([routing] if routing else []),
        "",
        *sharing,
        *([""] if sharing else []),
        f"{'fits' if fits else 'does NOT fit'} in {gpu_memory_gb:g} GB per GPU "
        f"(the memory model: dapo_megatron/policy/memory.py)",
    ]
    return "\n".join(lines), fits


def lora_line(config: DAPOConfig, spec: ModelSpec) -> str:
    lora = config.model.lora
    sizes = adapter_sizes(spec, rank=lora.rank, target_modules=lora.target_modules)
    return (f"LoRA: rank {lora.rank} on {', '.join(lora.target_modules)}: {sizes.trainable / 1e6:.1f}M trained "
            f"parameters ({100 * sizes.trainable_fraction:.2f} % of {sizes.model / 1e9:.2f}B), the base frozen "
            f"(no gradients, no optimizer state); handoff: {lora.handoff}")


def routing_replay_line(config: DAPOConfig, spec: ModelSpec, stages, *, data_parallel: int) -> str | None:
    """With routing replay, the routing a rank records for its share of a step's tokens (at most every sample at the
    prompt and response limits), which waits in pinned host memory until the last update replays it
    (:func:`dapo_megatron.policy.moe_routing.recorded_routing_bytes`); None without replay."""
    if spec.moe is None or config.algorithm.moe_routing_replay == "none":
        return None
    c = config
    samples = c.trainer.train_batch_size * c.rollout.n_samples / data_parallel
    tokens = int(samples * (c.data.max_prompt_length + c.rollout.max_response_length))
    layers = max(stage.layers for stage in stages)
    host = recorded_routing_bytes(tokens=tokens, layers=layers, topk=spec.moe.topk)
    line = (f"routing replay ({c.algorithm.moe_routing_replay}): up to {host / 1e9:.2f} GB of recorded routing per "
            f"rank and step in pinned host memory ({tokens:,} tokens x {layers} layers x top-{spec.moe.topk}, int16), "
            f"none on the GPU")
    if c.algorithm.moe_routing_replay != "replay_rollout":
        return line
    # R3: the engine's routing of every sample of the step travels with the batch, to every rank, on the host
    per_sample = rollout_routing_bytes(tokens=c.data.max_prompt_length + c.rollout.max_response_length - 1,
                                       layers=spec.num_layers, topk=spec.moe.topk)
    batch = per_sample * c.trainer.train_batch_size * c.rollout.n_samples
    return (f"{line}; plus the engine's routing of the step's batch on every rank's host: up to "
            f"{per_sample / 1e6:.1f} MB a sample ({spec.num_layers} layers), {batch / 1e9:.2f} GB a step")
