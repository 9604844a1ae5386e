"""``dapo-megatron plan``: the training ranks' GPU memory per pipeline stage for a config
(:mod:`dapo_megatron.policy.memory.gpu`), then what shares its GPUs (colocated servers:
:mod:`dapo_megatron.rollout.gpu_sharing`) and the host memory per node (:mod:`dapo_megatron.policy.memory.host`);
exit 1 when something does not fit."""

from __future__ import annotations

import argparse

from dapo_megatron.config import ConfigError, DAPOConfig
from dapo_megatron.policy.memory.host import (
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_HOST_MEMORY_GB,
    host_memory,
    host_memory_lines,
)
from dapo_megatron.policy.memory.lora import with_lora
from dapo_megatron.policy.lora.sizes import adapter_sizes
from dapo_megatron.policy.memory.gpu import GB, memory_table, plan_stages
from dapo_megatron.policy.model_spec import ModelSpec
from dapo_megatron.rollout.gpu_sharing import optimizer_offloading_ranks, sharing_report
from dapo_megatron.run.model_source import model_spec_for_plan


def run(args: argparse.Namespace, config: DAPOConfig) -> int:
    spec, origin = model_spec_for_plan(config)
    gpu_memory_gb = args.gpu_memory_gb or config.parallel.gpu_memory_gb or 80.0
    host_memory_gb = args.host_memory_gb or config.parallel.host_memory_gb or DEFAULT_HOST_MEMORY_GB
    report, fits = plan_report(config, spec, origin, data_parallel=args.data_parallel,
                               gpu_memory_gb=gpu_memory_gb, local_spec=args.local_spec,
                               host_memory_gb=host_memory_gb, gpus_per_node=args.gpus_per_node)
    print(report)
    return 0 if fits else 1


def plan_report(config: DAPOConfig, spec: ModelSpec, origin: str, *, data_parallel: int | None = None,
                gpu_memory_gb: float = 80.0, local_spec: bool = False, host_memory_gb: float = DEFAULT_HOST_MEMORY_GB,
                gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> tuple[str, bool]:
    """``dapo-megatron plan``: (the printed report, whether every stage fits ``gpu_memory_gb`` and every node
    ``host_memory_gb``) for ``config``'s layout of ``spec``, whose shape came from ``origin``, on nodes of
    ``gpus_per_node`` GPUs.

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
    if lora.enabled:  # the base frozen, the adapters trained (policy/memory/lora.py)
        stages = with_lora(stages, spec, lora, tensor_parallel=p.tensor, data_parallel=dp, expert_parallel=p.expert,
                           precision=config.model.precision, distributed_optimizer=p.use_distributed_optimizer,
                           micro_batch_tokens=config.trainer.micro_batch_tokens, transformer_engine=not local_spec,
                           recompute=config.model.recompute, sequence_parallel=sequence_parallel)
    routing = routing_replay_line(config, spec, stages)
    sharing, sharing_fits = sharing_report(config, spec, stages, data_parallel=dp, gpu_memory_gb=gpu_memory_gb)
    world = p.tensor * p.pipeline * dp
    host = host_memory(config, spec, stages, data_parallel=dp, sequence_parallel=sequence_parallel,
                       ranks_per_node=min(gpus_per_node, world),
                       offloading_ranks=optimizer_offloading_ranks(config, ranks_on_node=min(gpus_per_node, world)))
    host_lines, host_fits = host_memory_lines(host, config, budget_gb=host_memory_gb)
    gpu_fits = all(stage.total_bytes <= gpu_memory_gb * 1e9 for stage in stages) and sharing_fits
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
        *host_lines,
        *([""] if host_lines else []),
        f"{'fits' if gpu_fits else 'does NOT fit'} in {gpu_memory_gb:g} GB per GPU"
        + (f"; the host memory {'fits' if host_fits else 'does NOT fit'} in {host_memory_gb:g} GB per node (the memory "
           f"model: dapo_megatron/policy/memory/gpu.py, host.py)" if host_lines
           else " (the memory model: dapo_megatron/policy/memory/gpu.py)"),
    ]
    return "\n".join(lines), gpu_fits and host_fits


def lora_line(config: DAPOConfig, spec: ModelSpec) -> str:
    lora = config.model.lora
    sizes = adapter_sizes(spec, rank=lora.rank, target_modules=lora.target_modules)
    return (f"LoRA: rank {lora.rank} on {', '.join(lora.target_modules)}: {sizes.trainable / 1e6:.1f}M trained "
            f"parameters ({100 * sizes.trainable_fraction:.2f} % of {sizes.model / 1e9:.2f}B), the base frozen "
            f"(no gradients, no optimizer state); handoff: {lora.handoff}")


def routing_replay_line(config: DAPOConfig, spec: ModelSpec, stages) -> str | None:
    """With routing replay, what it keeps on the GPU (in the stage totals above); None without replay."""
    if spec.moe is None or config.algorithm.moe_routing_replay == "none":
        return None
    largest = max(stages, key=lambda stage: stage.routing_bytes)
    held = ("with model.recompute: full, each micro-batch in flight keeps its own until its recomputed forward"
            if config.model.recompute == "full" else "one micro-batch's at a time")
    return (f"routing replay ({config.algorithm.moe_routing_replay}) on the GPU: "
            f"{largest.routing_bytes / GB * 1e3:.1f} MB of int64 targets on stage {largest.stage}, in its total "
            f"({held}); on the host: below")
