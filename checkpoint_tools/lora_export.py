"""A LoRA run's checkpoint → a PEFT adapter folder (default), or with ``--merged`` a Hugging Face model with the
adapter merged into the base.

    python -m checkpoint_tools.lora_export --ckpt DIR --out DIR [--merged] [--base HF_DIR] [--tp N --pp M --ep E]
                                           [--dtype bf16|fp32] [--force]

``--ckpt`` is a trainer checkpoint of a run with ``model.lora.enabled`` (or its run folder: the latest complete one);
its ``model/`` holds the adapters alone and its ``config.yaml`` their rank, alpha and modules. ``--base``: the HF
folder of the frozen base, needed by ``--merged`` (default: the run's initial model, ``model.hf_path`` or the tiny
model the run made).

* PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors`` with the names HF's ``peft`` reads
  (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; :mod:`dapo_megatron.hf_format.peft_adapter`):
  ``PeftModel.from_pretrained(base, out)`` computes what the trainer's policy computed. A fused megatron linear
  shares its ``A`` between its HF modules (q/k/v, gate/up), which PEFT's format spells out per module.
* ``--merged``: every rank loads its shard of the base, then the adapters, merges ``W + (alpha / r) · B A`` into its
  shard (a local product: no collective) and the merged stage is written as :mod:`checkpoint_tools.megatron_to_hf`
  writes a model.

The ranks build the model with the same adapters as the trainer (:func:`dapo_megatron.policy.lora.adapter.add_adapters`)
at any TP/PP layout; the adapters are checked against the checkpoint by name and shape before they load.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint_tools.driver import check_output_dir, checked_spec, conversion_options, run_cli, run_conversion
from checkpoint_tools.errors import ConversionError
from checkpoint_tools.megatron_source import dominant_dtype, read_checkpoint_metadata, resolve_checkpoint
from checkpoint_tools.megatron_to_hf import (
    DEFAULT_MAX_SHARD_SIZE,
    MODEL_DTYPES,
    OUTPUT_DTYPES,
    MegatronToHfJob,
    build_parser as megatron_to_hf_parser,
    parse_size,
)
from dapo_megatron.checkpoint.layout import CONFIG_FILE as RUN_CONFIG_FILE
from dapo_megatron.config.model import LoRAConfig
from dapo_megatron.hf_format import CONFIG_FILE


@dataclass(frozen=True)
class LoRAExportJob(MegatronToHfJob):
    lora: LoRAConfig
    merged: bool
    base: Path | None  # the frozen base's HF folder (merged exports load it)

    tool = "lora_export"

    def adapt(self, model) -> None:
        from dapo_megatron.policy.lora.adapter import add_adapters

        add_adapters(model, self.lora, seed=0)  # the values are loaded from the checkpoint

    def fill(self, model, spec) -> None:
        from dapo_megatron.policy.hf_loader import load_hf_weights
        from dapo_megatron.policy.lora.adapter import merge_adapters

        if self.merged:
            load_hf_weights(model, spec, self.base)
        super().fill(model, spec)  # the adapters: checked against the checkpoint, then loaded
        if self.merged:
            merge_adapters(model)

    def write_rank_part(self, model, spec, staging: Path):
        if self.merged:
            return super().write_rank_part(model, spec, staging)
        from dapo_megatron.handoff.adapter import gather_adapter_to_rank0
        from dapo_megatron.hf_format.peft_adapter import write_peft_adapter

        lora = self.lora
        adapter = gather_adapter_to_rank0(model, spec, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                          base_model=str(self.base) if self.base is not None else None)
        if adapter is not None:
            adapter.tensors = {name: tensor.to(self.output_dtype) for name, tensor in adapter.tensors.items()}
            write_peft_adapter(staging, adapter)
        return None

    def write_rank0_files(self, staging: Path, parts: list) -> None:
        if self.merged:
            super().write_rank0_files(staging, parts)


def run_lora_settings(model_dir: Path) -> tuple[LoRAConfig, Path]:
    """(the run's ``model.lora``, its initial model folder) from the checkpoint's ``config.yaml``."""
    from dapo_megatron.config import ConfigError, load_config
    from dapo_megatron.run.model_source import initial_model_dir

    path = model_dir.parent / RUN_CONFIG_FILE
    if not path.is_file():
        raise ConversionError(f"no {path}: lora_export reads a trainer checkpoint of a LoRA run (its config.yaml "
                              f"holds the adapters' rank and modules)")
    try:
        config = load_config(path)
    except ConfigError as error:
        raise ConversionError(f"{path}: {error}") from None
    if not config.model.lora.enabled:
        raise ConversionError(f"{model_dir.parent} is a checkpoint of a run without LoRA (model.lora.enabled is "
                              f"false): convert it with python -m checkpoint_tools.megatron_to_hf")
    return config.model.lora, initial_model_dir(config)


def plan_lora_export(ckpt: str | Path, out: str | Path, *, merged: bool = False, base: str | Path | None = None,
                     tensor_parallel: int = 1, pipeline_parallel: int = 1, expert_parallel: int = 1,
                     dtype: str | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                     force: bool = False) -> LoRAExportJob:
    """Check the request without loading weights (the checkpoint, its LoRA settings, the base, the output)."""
    ckpt, out = Path(ckpt), Path(out)
    source = resolve_checkpoint(ckpt, None)
    lora, initial = run_lora_settings(source.model_dir)
    base = Path(base) if base is not None else initial
    if merged and not (base / CONFIG_FILE).is_file():
        raise ConversionError(f"--merged needs the frozen base's Hugging Face folder: {base} has no {CONFIG_FILE} "
                              f"(pass --base)")
    check_output_dir(out, force=force, inputs=(source.model_dir, source.side_files_dir)
                     + ((base,) if merged else ()))
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise ConversionError(f"--dtype must be one of {sorted(OUTPUT_DTYPES)}, got {dtype!r}")
    checked_spec(source.side_files_dir, tensor_parallel, pipeline_parallel, expert_parallel)
    stored = dominant_dtype(read_checkpoint_metadata(source.model_dir))
    return LoRAExportJob(out=out, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                         expert_parallel=expert_parallel, force=force, source=source,
                         model_dtype=stored if stored in MODEL_DTYPES else torch.float32,
                         output_dtype=OUTPUT_DTYPES[dtype] if dtype is not None else stored,
                         max_shard_bytes=max_shard_size if isinstance(max_shard_size, int)
                         else parse_size(max_shard_size), lora=lora, merged=merged, base=base)


def export_lora(ckpt: str | Path, out: str | Path, **options) -> Path:
    """Check, then export on ``tensor_parallel × pipeline_parallel × expert_parallel`` ranks; returns ``out``."""
    return run_conversion(plan_lora_export(ckpt, out, **options))


def build_parser() -> argparse.ArgumentParser:
    parser = megatron_to_hf_parser()
    parser.prog = f"python -m checkpoint_tools.{LoRAExportJob.tool}"
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--merged", action="store_true", help="write the base with the adapter merged in, as an HF "
                                                              "model (default: the PEFT adapter folder)")
    parser.add_argument("--base", type=Path, default=None, help="the frozen base's HF folder (default: the run's "
                                                                "initial model)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.hf_config_from is not None:
        print(f"{LoRAExportJob.tool}: error: --hf-config-from is megatron_to_hf's; the config comes from the "
              f"checkpoint's hf/", file=sys.stderr)
        return 2
    return run_cli(LoRAExportJob.tool, lambda: export_lora(args.ckpt, args.out, merged=args.merged, base=args.base,
                                                           max_shard_size=args.max_shard_size,
                                                           **conversion_options(args)))


if __name__ == "__main__":  # required: dist_checkpointing spawns a Manager that re-imports __main__
    sys.exit(main())
