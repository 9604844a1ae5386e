"""megatron-core distributed checkpoint → Hugging Face folder that ``transformers`` and SGLang load.

    python -m checkpoint_tools.megatron_to_hf --ckpt DIR --out DIR [--hf-config-from DIR] [--tp N --pp M --ep E]
                                              [--dtype bf16|fp32] [--max-shard-size 2GB] [--force]

``--ckpt`` is a trainer checkpoint, the output of :mod:`checkpoint_tools.hf_to_megatron`, a distributed checkpoint
folder, or a run whose latest complete checkpoint is converted (:mod:`checkpoint_tools.megatron_source`).
``--hf-config-from DIR`` takes config.json, generation_config.json and the tokenizer from DIR instead.

The output holds sharded safetensors (``model-0000i-of-0000n.safetensors``, each at most ``--max-shard-size``) with
``model.safetensors.index.json``, plus config.json (its ``dtype`` set to the weights' dtype), generation_config.json
and the tokenizer files.

How: the checkpoint is checked first without loading it. Then N×M ranks (any layout, independent of the one the
checkpoint was written with) each build their stage's ``GPTModel`` with megatron's local layer spec (the checkpoint
keys of the local and Transformer Engine specs are the same), compare the checkpoint's tensors with what the model
needs — missing, unexpected and mis-shaped tensors are listed by name — and load their shards
(``dapo_megatron.checkpoint.load_model``). Each stage's TP-0 rank turns its stage into full HF tensors one at a time
(:func:`dapo_megatron.handoff.exporter.export_hf_buckets`) and streams each into its stage's safetensors files,
planned up front from the weight mapping (:mod:`dapo_megatron.hf_format.writer`); rank 0 names the files and writes
the index. Peak memory: each rank holds its 1/(N·M) of the model; a stage's TP-0 rank additionally the TP shards and
the full HF tensor of the one parameter being written.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint_tools.driver import (
    ConversionJob,
    check_output_dir,
    checked_spec,
    conversion_options,
    conversion_parser,
    run_cli,
    run_conversion,
)
from checkpoint_tools.errors import ConversionError
from checkpoint_tools.megatron_source import (
    CheckpointSource,
    check_checkpoint_fits_model,
    dominant_dtype,
    read_checkpoint_metadata,
    resolve_checkpoint,
)
from dapo_megatron.hf_format import CONFIG_FILE, Bucket, bucketed, copy_side_files, name_shards, write_shard

OUTPUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODEL_DTYPES = (torch.float32, torch.bfloat16)  # what megatron builds; other stored dtypes load into fp32
DEFAULT_MAX_SHARD_SIZE = "2GB"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"2GB"``, ``"500MB"``, ``"1GiB"`` or plain bytes → bytes (KB/MB/GB are powers of 1000, KiB/... of 1024)."""
    match = _SIZE.match(str(text))
    if not match:
        raise ConversionError(f"--max-shard-size {text!r} is not a size like 2GB, 500MB or 1073741824")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}.get(unit)
    if scale is None or number * scale < 1:
        raise ConversionError(f"--max-shard-size {text!r}: unknown unit or not positive")
    return int(number * scale)


def stage_layout(model, spec, dtype: torch.dtype) -> Bucket:
    """Every HF tensor this rank's pipeline stage exports, in the exporter's order, as ``meta`` tensors (name,
    shape and dtype, no data): what the stage's files are planned from."""
    from dapo_megatron.handoff.exporter import stage_export_mappings
    from dapo_megatron.policy.weight_mapping import ShardGeometry, hf_shapes

    geometry = ShardGeometry(spec, 1)  # full HF shapes: independent of the TP size
    return [(name, torch.empty(shape, dtype=dtype, device="meta"))
            for mapping in stage_export_mappings(model, spec)
            for name, shape in zip(mapping.hf_names, hf_shapes(mapping, geometry), strict=True)]


def write_side_files(src_dir: Path, dst_dir: Path, dtype: torch.dtype) -> None:
    """Copy config, generation config and tokenizer; set the config's dtype to the one the weights are written in."""
    copy_side_files(src_dir, dst_dir)
    config_path = dst_dir / CONFIG_FILE
    config = json.loads(config_path.read_text())
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    if any(config.get(k) != name for k in keys):
        config.update({k: name for k in keys})
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class MegatronToHfJob(ConversionJob):
    source: CheckpointSource
    model_dtype: torch.dtype  # parameters of the model the checkpoint is loaded into
    output_dtype: torch.dtype
    max_shard_bytes: int

    tool = "megatron_to_hf"
    kernels = "local"  # megatron's local layers: their checkpoint keys are TE's, and they run everywhere

    @property
    def input_dir(self) -> Path:
        return self.source.model_dir

    @property
    def config_dir(self) -> Path:
        return self.source.side_files_dir

    @property
    def params_dtype(self) -> torch.dtype:
        return self.model_dtype

    @property
    def written_dtype(self) -> torch.dtype:
        return self.output_dtype

    def fill(self, model, spec) -> None:
        from dapo_megatron.checkpoint import load_model

        check_checkpoint_fits_model(model, read_checkpoint_metadata(self.source.model_dir), spec, self.source)
        load_model([model], self.source.model_dir)

    def write_rank_part(self, model, spec, staging: Path) -> tuple[int, list]:
        """Each stage's source (TP 0 / DP 0) streams its tensors into its planned files; the other ranks only take
        part in the exporter's TP gathers. Returns (stage, files written)."""
        from megatron.core import parallel_state

        from dapo_megatron.handoff.exporter import export_hf_buckets

        stage = parallel_state.get_pipeline_model_parallel_rank()
        is_stage_source = (parallel_state.get_tensor_model_parallel_rank() == 0
                           and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)
        plan = list(bucketed(stage_layout(model, spec, self.output_dtype), self.max_shard_bytes)) \
            if is_stage_source else []
        buckets = export_hf_buckets(model, spec, bucket_bytes=1, dtype=self.output_dtype)  # one tensor per bucket
        tensors = (item for bucket in buckets for item in bucket)
        written = [write_shard(staging / f"part-{stage:05d}-{i:05d}.safetensors", layout, tensors)
                   for i, layout in enumerate(plan)]
        extra = next(tensors, None)  # on the other ranks: runs the exporter's collectives to the end
        if extra is not None:
            raise RuntimeError(f"the exporter produced {extra[0]}, which is not in this stage's plan")
        return stage, written

    def write_rank0_files(self, staging: Path, parts: list) -> None:
        by_stage = sorted((part for part in parts if part[1]), key=lambda part: part[0])
        name_shards(staging, [shard for _, shards in by_stage for shard in shards])
        write_side_files(self.source.side_files_dir, staging, self.output_dtype)


def require_full_weights(metadata, source: CheckpointSource) -> None:
    """A LoRA run's checkpoint holds its adapters alone (the base is the run's HF folder): say which tool reads it."""
    from dapo_megatron.policy.lora.names import is_adapter_parameter

    keys = list(metadata.state_dict_metadata)
    if keys and all(is_adapter_parameter(key) for key in keys):
        raise ConversionError(f"{source.model_dir} holds LoRA adapters alone (a run with model.lora.enabled): "
                              f"python -m checkpoint_tools.lora_export writes them as a PEFT folder, or with --merged "
                              f"the base with the adapter merged in")


def plan_megatron_to_hf(ckpt: str | Path, out: str | Path, *, hf_config_from: str | Path | None = None,
                        tensor_parallel: int = 1, pipeline_parallel: int = 1, expert_parallel: int = 1,
                        dtype: str | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                        force: bool = False) -> MegatronToHfJob:
    """Check the request without loading weights: checkpoint found and intact, config supported, layout possible."""
    ckpt, out = Path(ckpt), Path(out)
    source = resolve_checkpoint(ckpt, Path(hf_config_from) if hf_config_from is not None else None)
    check_output_dir(out, force=force, inputs=(source.model_dir, source.side_files_dir))
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise ConversionError(f"--dtype must be one of {sorted(OUTPUT_DTYPES)}, got {dtype!r}")
    max_shard_bytes = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    checked_spec(source.side_files_dir, tensor_parallel, pipeline_parallel, expert_parallel)
    metadata = read_checkpoint_metadata(source.model_dir)
    require_full_weights(metadata, source)
    stored = dominant_dtype(metadata)
    return MegatronToHfJob(out=out, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                           expert_parallel=expert_parallel, force=force,
                           source=source, model_dtype=stored if stored in MODEL_DTYPES else torch.float32,
                           output_dtype=OUTPUT_DTYPES[dtype] if dtype is not None else stored,
                           max_shard_bytes=max_shard_bytes)


def convert_megatron_to_hf(ckpt: str | Path, out: str | Path, *, hf_config_from: str | Path | None = None,
                           tensor_parallel: int = 1, pipeline_parallel: int = 1, expert_parallel: int = 1,
                           dtype: str | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                           force: bool = False) -> Path:
    """Check, then convert on ``tensor_parallel × pipeline_parallel × expert_parallel`` ranks; returns ``out`` (or
    ConversionError)."""
    return run_conversion(plan_megatron_to_hf(ckpt, out, hf_config_from=hf_config_from,
                                              tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                                              expert_parallel=expert_parallel, dtype=dtype,
                                              max_shard_size=max_shard_size, force=force))


def build_parser() -> argparse.ArgumentParser:
    def input_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--ckpt", required=True, type=Path, help="checkpoint folder with model/ and hf/, a "
                                                                     "distributed checkpoint, or a run's checkpoints/")
        parser.add_argument("--hf-config-from", type=Path, default=None,
                            help="take config.json, generation_config.json and the tokenizer from this folder")

    parser = conversion_parser(MegatronToHfJob.tool, __doc__, input_arguments=input_arguments,
                               out_help="output Hugging Face folder", dtypes=OUTPUT_DTYPES,
                               dtype_help="dtype of the written weights (default: the dtype of the checkpoint's "
                                          "weights)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help="largest safetensors file, e.g. 2GB or 500MB (a single larger tensor gets a file alone)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(MegatronToHfJob.tool, lambda: convert_megatron_to_hf(
        args.ckpt, args.out, hf_config_from=args.hf_config_from, max_shard_size=args.max_shard_size,
        **conversion_options(args)))


if __name__ == "__main__":  # required: dist_checkpointing spawns a Manager that re-imports __main__
    sys.exit(main())
