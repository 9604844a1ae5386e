"""megatron-core distributed checkpoint → Hugging Face folder that ``transformers`` and SGLang load.

    python -m checkpoint_tools.megatron_to_hf --ckpt DIR --out DIR [--hf-config-from DIR] [--tp N --pp M]
                                              [--dtype bf16|fp32] [--max-shard-size 2GB] [--force]

``--ckpt`` is one of
  * a checkpoint folder holding ``model/`` (the distributed checkpoint) and ``hf/`` (config + tokenizer): a trainer
    checkpoint ``<run>/checkpoints/step_000012/`` or the output of :mod:`checkpoint_tools.hf_to_megatron`;
  * the distributed checkpoint folder itself (it holds ``metadata.json``); config from a sibling ``hf/``;
  * a folder of trainer checkpoints (``<run>/checkpoints`` or ``<run>``): the latest complete one is converted.
``--hf-config-from DIR`` takes config.json, generation_config.json and the tokenizer from DIR instead.

The output holds sharded safetensors (``model-0000i-of-0000n.safetensors``, each at most ``--max-shard-size``) with
``model.safetensors.index.json``, plus config.json (its ``dtype`` set to the weights' dtype), generation_config.json
and the tokenizer files.

How: the checkpoint is checked first without loading it (readable metadata, every data file present and long
enough). Then N×M ranks (any layout, independent of the one the checkpoint was written with) each build their
stage's ``GPTModel`` with megatron's local layer spec (the checkpoint keys of the local and Transformer Engine specs
are the same), compare the checkpoint's tensors with what the model needs — missing, unexpected and mis-shaped
tensors are listed by name — and load their shards (``trainer.checkpoint.load_model``). Each stage's TP-0 rank
turns its stage into full HF tensors one at a time (:func:`dapo_megatron.handoff.exporter.export_hf_buckets`) and
streams each into its stage's safetensors files, planned up front (:mod:`checkpoint_tools.hf_writer`); rank 0 names
the files and writes the index. Peak memory: each rank holds its 1/(N·M) of the model; a stage's TP-0 rank
additionally the TP shards and the full HF tensor of the one parameter being written.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from checkpoint_tools.errors import ConversionError
from checkpoint_tools.hf_folder import CONFIG_FILE, copy_side_files, load_config
from checkpoint_tools.hf_writer import PlannedTensor, name_shards_and_write_index, plan_shards, write_planned_shards
from checkpoint_tools.launch import (
    RankFailedError,
    agree_on_error,
    launched_by_torchrun,
    quiet_backend_warnings,
    run_ranks,
    shared_staging_dir,
)
from checkpoint_tools.output_dir import check_output_dir, discard, make_staging_dir, publish

DIST_CHECKPOINT_MARKER = "metadata.json"  # written by megatron's dist_checkpointing next to torch DCP's .metadata
MODEL_SUBDIR = "model"
HF_SUBDIR = "hf"
OUTPUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODEL_DTYPES = (torch.float32, torch.bfloat16)  # what megatron builds; other stored dtypes load into fp32
DEFAULT_MAX_SHARD_SIZE = "2GB"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class CheckpointSource:
    """Where the weights and the side files (config, tokenizer) of a checkpoint are."""

    model_dir: Path
    side_files_dir: Path


@dataclass(frozen=True)
class MegatronToHfJob:
    source: CheckpointSource
    out: Path
    tensor_parallel: int
    pipeline_parallel: int
    model_dtype: torch.dtype  # parameters of the model the checkpoint is loaded into
    output_dtype: torch.dtype
    max_shard_bytes: int
    force: bool

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


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


def _is_incomplete_trainer_checkpoint(folder: Path) -> bool:
    looks_like_trainer = (folder / "trainer_state.pt").exists() or (folder / "optimizer").is_dir()
    return folder.name.endswith(".tmp") or (looks_like_trainer and not (folder / "COMPLETE").exists())


def resolve_checkpoint(ckpt: Path, hf_config_from: Path | None) -> CheckpointSource:
    """Find the distributed checkpoint and the side files for ``--ckpt`` (see the module docstring)."""
    from dapo_megatron.trainer.checkpoint import latest_checkpoint

    if not ckpt.is_dir():
        raise ConversionError(f"--ckpt {ckpt} is not a directory")
    if (ckpt / MODEL_SUBDIR / DIST_CHECKPOINT_MARKER).is_file():
        root, model_dir, side = ckpt, ckpt / MODEL_SUBDIR, ckpt / HF_SUBDIR
    elif (ckpt / DIST_CHECKPOINT_MARKER).is_file():
        root, model_dir, side = ckpt.parent, ckpt, ckpt.parent / HF_SUBDIR
    else:
        latest = latest_checkpoint(ckpt) or latest_checkpoint(ckpt / "checkpoints")
        if latest is None:
            raise ConversionError(
                f"--ckpt {ckpt} is not a checkpoint: expected {ckpt / MODEL_SUBDIR / DIST_CHECKPOINT_MARKER} (a "
                f"trainer checkpoint step_N/ or hf_to_megatron output), {ckpt / DIST_CHECKPOINT_MARKER} (a "
                f"distributed checkpoint) or complete step_N/ checkpoints under {ckpt} or {ckpt / 'checkpoints'}"
            )
        print(f"[megatron_to_hf] converting the latest complete checkpoint {latest}", file=sys.stderr)
        root, model_dir, side = latest, latest / MODEL_SUBDIR, latest / HF_SUBDIR
    if _is_incomplete_trainer_checkpoint(root):
        raise ConversionError(f"{root} is an incomplete trainer checkpoint (no COMPLETE marker): the run stopped while "
                              f"writing it; convert a complete one")
    side = hf_config_from if hf_config_from is not None else side
    if not (side / CONFIG_FILE).is_file():
        raise ConversionError(f"no {side / CONFIG_FILE}: pass --hf-config-from with the model's Hugging Face folder")
    return CheckpointSource(model_dir, side)


def read_checkpoint_metadata(model_dir: Path):
    """torch DCP metadata of the checkpoint, after checking that every data file it points into is long enough."""
    from torch.distributed.checkpoint import FileSystemReader

    marker = json.loads((model_dir / DIST_CHECKPOINT_MARKER).read_text() or "{}")
    backend = marker.get("sharded_backend")
    if backend != "torch_dist":
        raise ConversionError(f"{model_dir} uses dist_checkpointing backend {backend!r}; only 'torch_dist' is read")
    try:
        metadata = FileSystemReader(str(model_dir)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same thing here
        problem = f"{type(exc).__name__}: {exc}"
        raise ConversionError(f"{model_dir / '.metadata'} is missing or corrupted ({problem})") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        path = model_dir / name
        if not path.is_file():
            raise ConversionError(f"{path} is missing: the checkpoint's metadata stores tensors in it")
        if path.stat().st_size < end:
            raise ConversionError(f"{path} is truncated: {path.stat().st_size} bytes, the metadata needs {end}")
    return metadata


def dominant_dtype(metadata) -> torch.dtype:
    """The dtype most stored elements have: the weights' dtype (megatron's local spec keeps norms in fp32)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    elements: dict[torch.dtype, int] = {}
    for item in metadata.state_dict_metadata.values():
        if isinstance(item, TensorStorageMetadata):
            elements[item.properties.dtype] = elements.get(item.properties.dtype, 0) + item.size.numel()
    if not elements:
        raise ConversionError("the checkpoint holds no tensors")
    return max(elements, key=elements.__getitem__)


def plan_megatron_to_hf(ckpt: str | Path, out: str | Path, *, hf_config_from: str | Path | None = None,
                        tensor_parallel: int = 1, pipeline_parallel: int = 1, dtype: str | None = None,
                        max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, force: bool = False) -> MegatronToHfJob:
    """Check the request without loading weights: checkpoint found and intact, config supported, layout possible."""
    from dapo_megatron.policy.model import (
        ParallelLayoutError,
        UnsupportedModelError,
        check_parallel_layout,
        model_spec_from_hf,
    )

    ckpt, out = Path(ckpt), Path(out)
    source = resolve_checkpoint(ckpt, Path(hf_config_from) if hf_config_from is not None else None)
    check_output_dir(out, force=force, inputs=(source.model_dir, source.side_files_dir))
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise ConversionError(f"--dtype must be one of {sorted(OUTPUT_DTYPES)}, got {dtype!r}")
    max_shard_bytes = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    try:
        spec = model_spec_from_hf(load_config(source.side_files_dir))
        check_parallel_layout(spec, tensor_parallel, pipeline_parallel)
    except (UnsupportedModelError, ParallelLayoutError) as exc:
        raise ConversionError(f"{source.side_files_dir / CONFIG_FILE}: {exc}") from None
    stored = dominant_dtype(read_checkpoint_metadata(source.model_dir))
    model_dtype = stored if stored in MODEL_DTYPES else torch.float32
    output_dtype = OUTPUT_DTYPES[dtype] if dtype is not None else stored
    return MegatronToHfJob(source, out, tensor_parallel, pipeline_parallel, model_dtype, output_dtype,
                           max_shard_bytes, force)


def _log(message: str) -> None:
    print(f"[megatron_to_hf] {message}", file=sys.stderr, flush=True)


def _sharded_tensors(item: Any) -> list:
    """The ShardedTensors / ShardedObjects of one sharded-state-dict entry (factories built into their parts)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(item, ShardedTensorFactory):
        return _sharded_tensors(item.build())
    if isinstance(item, dict):
        return [leaf for value in item.values() for leaf in _sharded_tensors(value)]
    if isinstance(item, (list, tuple)):
        return [leaf for value in item for leaf in _sharded_tensors(value)]
    return [item]


def _local_mismatches(model, metadata, vocab_size: int) -> tuple[set[str], dict[str, str]]:
    """(checkpoint keys this rank's model needs, key → problem) from the model's own sharded state dict.

    Vocabulary-padded tensors (``allow_shape_mismatch``: embedding, output layer) may have any number of rows at or
    above the real vocabulary size — the padding depends on the TP size the checkpoint was written at.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dapo_megatron.trainer.checkpoint import model_sharded_state_dict

    stored = metadata.state_dict_metadata
    needed: set[str] = set()
    problems: dict[str, str] = {}
    for entry in model_sharded_state_dict([model]).values():
        for leaf in _sharded_tensors(entry):
            if isinstance(leaf, ShardedObject):
                needed.add(leaf.unique_key)
                if leaf.unique_key not in stored:
                    problems[leaf.unique_key] = "missing"
                continue
            if not isinstance(leaf, ShardedTensor):
                continue
            needed.add(leaf.key)
            found = stored.get(leaf.key)
            if not isinstance(found, TensorStorageMetadata):
                problems[leaf.key] = "missing"
                continue
            have, want = list(found.size), list(leaf.global_shape)
            if leaf.allow_shape_mismatch:
                fits = have[1:] == want[1:] and have[0] >= vocab_size
                want_text = f"[>={vocab_size}, {', '.join(map(str, want[1:]))}]"
            else:
                fits, want_text = have == want, str(want)
            if not fits:
                problems[leaf.key] = f"shape: checkpoint {have}, model {want_text}"
    return needed, problems


def check_checkpoint_fits_model(model, metadata, spec, job: MegatronToHfJob) -> None:
    """Every rank raises the same error listing missing, unexpected and mis-shaped tensors (by checkpoint key)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    local = _local_mismatches(model, metadata, spec.vocab_size)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    needed = set().union(*(n for n, _ in gathered))
    problems = {k: v for _, p in gathered for k, v in p.items()}
    missing = sorted(k for k, v in problems.items() if v == "missing")
    wrong = sorted(f"{k} {v}" for k, v in problems.items() if v != "missing")
    extra = sorted(k for k, m in metadata.state_dict_metadata.items()
                   if isinstance(m, TensorStorageMetadata) and k not in needed)
    parts = ([f"missing tensors: {', '.join(missing)}"] if missing else []) + (
        [f"unexpected tensors: {', '.join(extra)}"] if extra else []) + (
        [f"shape mismatches: {'; '.join(wrong)}"] if wrong else [])
    if parts:
        raise ConversionError(f"checkpoint {job.source.model_dir} does not match "
                              f"{job.source.side_files_dir / CONFIG_FILE}: " + " | ".join(parts))


def stage_hf_tensors(model, spec, dtype: torch.dtype) -> list[PlannedTensor]:
    """Name, shape and dtype of every HF tensor this rank's pipeline stage exports, in the exporter's order."""
    from megatron.core import parallel_state

    from dapo_megatron.policy.hf_loader import model_stage_mappings
    from dapo_megatron.policy.weight_mapping import ShardGeometry, hf_shapes

    geometry = ShardGeometry(spec, parallel_state.get_tensor_model_parallel_world_size())
    return [PlannedTensor(name, shape, dtype) for mapping in model_stage_mappings(model, spec) if mapping.exported
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


def convert_on_rank(environ: Mapping[str, str] | None, job: MegatronToHfJob, staging: Path | None) -> None:
    """One rank's part: build this stage, check and load its shards, write its HF shards; rank 0 indexes, publishes."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dapo_megatron.handoff.exporter import export_hf_buckets
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.policy.model import build_model, model_spec_from_hf, transformer_config
    from dapo_megatron.trainer.checkpoint import CheckpointError, load_model

    init_distributed(job.tensor_parallel, job.pipeline_parallel, environ=environ)
    staging = shared_staging_dir(staging, job.out)
    rank0 = dist.get_rank() == 0
    try:
        started = time.perf_counter()
        spec = model_spec_from_hf(load_config(job.source.side_files_dir))
        precision = "bf16" if job.model_dtype == torch.bfloat16 else "fp32"
        tconfig = transformer_config(spec, tensor_parallel=job.tensor_parallel, pipeline_parallel=job.pipeline_parallel,
                                     params_dtype=job.model_dtype, precision=precision, use_transformer_engine=False)
        tconfig.perform_initialization = False  # every parameter is loaded from the checkpoint
        model = build_model(spec, tconfig, use_transformer_engine=False)
        check_checkpoint_fits_model(model, read_checkpoint_metadata(job.source.model_dir), spec, job)
        try:
            load_model([model], job.source.model_dir)
        except CheckpointError as exc:
            raise ConversionError(str(exc)) from None
        if rank0:
            _log(f"loaded {job.source.model_dir} at TP={job.tensor_parallel} PP={job.pipeline_parallel} "
                 f"({time.perf_counter() - started:.1f} s)")
        stage = parallel_state.get_pipeline_model_parallel_rank()
        shards = plan_shards(stage_hf_tensors(model, spec, job.output_dtype), job.max_shard_bytes, stage)
        buckets = export_hf_buckets(model, spec, bucket_bytes=1, dtype=job.output_dtype)  # one tensor per bucket
        named_tensors = (item for bucket in buckets for item in bucket)
        is_stage_source = (parallel_state.get_tensor_model_parallel_rank() == 0
                           and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)
        write_planned_shards(shards if is_stage_source else [], named_tensors, staging)  # others: TP gathers only
        written = shards if is_stage_source else []
        del model
        stages: list = [None] * dist.get_world_size()
        dist.all_gather_object(stages, (stage, written))
        error = None
        if rank0:
            try:
                by_stage = sorted(((s, files) for s, files in stages if files), key=lambda item: item[0])
                name_shards_and_write_index(staging, [files for _, files in by_stage])
                write_side_files(job.source.side_files_dir, staging, job.output_dtype)
                publish(staging, job.out, force=job.force)
                _log(f"wrote {job.out} ({str(job.output_dtype).removeprefix('torch.')}, "
                     f"{time.perf_counter() - started:.1f} s)")
            except (ConversionError, OSError) as exc:
                error = f"writing {job.out} failed: {exc}"
        agree_on_error(error)
    except BaseException:
        if rank0:
            discard(staging)
        raise
    finally:
        parallel_state.destroy_model_parallel()


def convert_megatron_to_hf(ckpt: str | Path, out: str | Path, *, hf_config_from: str | Path | None = None,
                           tensor_parallel: int = 1, pipeline_parallel: int = 1, dtype: str | None = None,
                           max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, force: bool = False) -> Path:
    """Check, then convert on ``tensor_parallel × pipeline_parallel`` ranks; returns ``out`` (or ConversionError)."""
    job = plan_megatron_to_hf(ckpt, out, hf_config_from=hf_config_from, tensor_parallel=tensor_parallel,
                              pipeline_parallel=pipeline_parallel, dtype=dtype, max_shard_size=max_shard_size,
                              force=force)
    if launched_by_torchrun():
        convert_on_rank(None, job, None)
        return job.out
    staging = make_staging_dir(job.out)
    try:
        run_ranks(convert_on_rank, job.world_size, job, staging)
    finally:
        discard(staging)
    return job.out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoint_tools.megatron_to_hf",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, type=Path,
                        help="checkpoint folder with model/ and hf/, a distributed checkpoint, or a run's checkpoints/")
    parser.add_argument("--out", required=True, type=Path, help="output Hugging Face folder")
    parser.add_argument("--hf-config-from", type=Path, default=None,
                        help="take config.json, generation_config.json and the tokenizer from this folder")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks used for the conversion")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks used for the conversion")
    parser.add_argument("--dtype", choices=sorted(OUTPUT_DTYPES), default=None,
                        help="dtype of the written weights (default: the dtype of the checkpoint's weights)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help="largest safetensors file, e.g. 2GB or 500MB (a single larger tensor gets a file alone)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_backend_warnings()
    try:
        convert_megatron_to_hf(args.ckpt, args.out, hf_config_from=args.hf_config_from, tensor_parallel=args.tp,
                               pipeline_parallel=args.pp, dtype=args.dtype, max_shard_size=args.max_shard_size,
                               force=args.force)
    except ConversionError as exc:
        print(f"megatron_to_hf: error: {exc}", file=sys.stderr)
        return 2
    except RankFailedError as exc:
        print(f"megatron_to_hf: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # required: dist_checkpointing spawns a Manager that re-imports __main__
    sys.exit(main())
