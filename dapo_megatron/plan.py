"""``dapo-megatron plan CONFIG``: the per-GPU memory of a run's training ranks, stage by stage, before launching it.

The model's shape comes from ``model.hf_path``'s ``config.json`` when that folder is here, else from the published
shape its folder is named after (:mod:`dapo_megatron.policy.shapes`; the 32B example points at a cluster path), or
for ``model.source = tiny`` from the prepared tiny model. The layout is the config's: TP and PP, DP from
``parallel.data`` (or ``--data-parallel``), the distributed optimizer, ``trainer.micro_batch_tokens``,
``model.precision`` and ``model.recompute``. It plans for the GPU production path — the Transformer Engine layer spec
(fused attention, sequence parallelism as :func:`dapo_megatron.policy.model.sequence_parallel_enabled` decides it);
``local_spec=True`` plans megatron's local spec instead (unfused attention, no sequence parallelism).
"""

from __future__ import annotations

from pathlib import Path

from dapo_megatron.config import ConfigError, DAPOConfig
from dapo_megatron.policy.memory import StageMemory, estimate_memory, memory_table
from dapo_megatron.policy.model import ModelSpec, model_spec_from_hf, sequence_parallel_enabled


def model_spec_for_plan(config: DAPOConfig) -> tuple[ModelSpec, str]:
    """(the model's spec, where its shape came from)."""
    from dapo_megatron.hf_format import load_hf_config
    from dapo_megatron.policy.shapes import published_hf_config, published_name

    if config.model.source == "tiny":
        from dapo_megatron.trainer.model_source import tiny_model_dir

        folder = Path(tiny_model_dir(config))
        if not (folder / "config.json").is_file():
            raise ConfigError(f"model.source: the tiny model's vocabulary comes from its tokenizer; run "
                              f"`dapo-megatron prepare-tiny` first (no {folder / 'config.json'})")
        return model_spec_from_hf(load_hf_config(folder)), str(folder / "config.json")
    folder = Path(config.model.hf_path)
    if (folder / "config.json").is_file():
        return model_spec_from_hf(load_hf_config(folder)), str(folder / "config.json")
    name = published_name(folder)
    if name is None:
        raise ConfigError(f"model.hf_path: {folder / 'config.json'} does not exist and the folder name is not one of "
                          f"the published shapes dapo_megatron.policy.shapes knows")
    return model_spec_from_hf(published_hf_config(name)), f"published {name} shape ({folder} is not on this machine)"


def plan_stages(config: DAPOConfig, spec: ModelSpec, *, data_parallel: int, local_spec: bool = False
                ) -> tuple[list[StageMemory], bool]:
    """(the per-stage estimate, whether sequence parallelism is in effect) for ``config``'s layout."""
    p = config.parallel
    sequence_parallel = sequence_parallel_enabled(p.sequence_parallel, tensor_parallel=p.tensor,
                                                  use_transformer_engine=not local_spec)
    stages = estimate_memory(
        spec, tensor_parallel=p.tensor, pipeline_parallel=p.pipeline, data_parallel=data_parallel,
        micro_batch_tokens=config.trainer.micro_batch_tokens, distributed_optimizer=p.use_distributed_optimizer,
        precision=config.model.precision, recompute=config.model.recompute, sequence_parallel=sequence_parallel,
        fused_attention=not local_spec,
    )
    return stages, sequence_parallel


def plan_report(config: DAPOConfig, *, data_parallel: int | None = None, gpu_memory_gb: float = 80.0,
                local_spec: bool = False) -> tuple[str, bool]:
    """(the printed report, whether every stage fits ``gpu_memory_gb``)."""
    spec, origin = model_spec_for_plan(config)
    p = config.parallel
    dp = data_parallel or p.data or 1
    stages, sequence_parallel = plan_stages(config, spec, data_parallel=dp, local_spec=local_spec)
    fits = all(stage.total_bytes <= gpu_memory_gb * 1e9 for stage in stages)
    lines = [
        f"model: {spec.arch}, {spec.num_layers} layers, hidden {spec.hidden_size}, vocab {spec.vocab_size} ({origin})",
        f"layout: TP {p.tensor} x PP {p.pipeline} x DP {dp}"
        + ("" if data_parallel or p.data else " (parallel.data unset: DP 1 assumed, the largest optimizer share)")
        + f", {'distributed' if p.use_distributed_optimizer else 'replicated'} optimizer, {config.model.precision}",
        f"per micro-batch: {config.trainer.micro_batch_tokens} tokens; recompute: {config.model.recompute}; "
        f"sequence parallel: {'on' if sequence_parallel else 'off'}; attention: "
        f"{'megatron local spec (unfused)' if local_spec else 'Transformer Engine (fused)'}",
        "",
        memory_table(stages, gpu_memory_gb=gpu_memory_gb),
        "",
        f"{'fits' if fits else 'does NOT fit'} in {gpu_memory_gb:g} GB per GPU "
        f"(the memory model: dapo_megatron/policy/memory.py)",
    ]
    return "\n".join(lines), fits
