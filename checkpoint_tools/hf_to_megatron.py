"""Hugging Face folder → megatron-core distributed checkpoint, loadable by the trainer at any TP/PP.

    python -m checkpoint_tools.hf_to_megatron --hf-dir DIR --out DIR --tp N --pp M [--dtype bf16|fp32] [--force]

Output layout (the same as a trainer checkpoint's ``model/`` and ``hf/``)::

    <out>/model/   megatron-core distributed checkpoint, exactly what ``trainer.checkpoint.save_model`` writes;
                   ``trainer.checkpoint.load_model`` loads it at any TP/PP (tensors are stored with global shapes)
    <out>/hf/      config.json, generation_config.json and tokenizer files copied from the HF folder

How: the input is checked from safetensors headers first (names, shapes, file integrity; see
:mod:`checkpoint_tools.hf_folder`). Then N×M ranks each build their pipeline stage's ``GPTModel`` (uninitialized:
every parameter is overwritten), read only their slice of each HF tensor (:func:`dapo_megatron.policy.hf_loader.
load_hf_weights`) and write their shards with ``dist_checkpointing``. Peak memory per rank is about its own share
of the model (1/(N·M) of it) plus one tensor slice being read; no rank ever holds the full state dict.

Ranks come from ``torchrun`` when RANK/WORLD_SIZE are set (the world may then be N·M·DP), else N·M processes are
spawned here (gloo on CPU, NCCL with one GPU per rank). The checkpoint's parameter dtype is ``--dtype``, by default
the dtype the HF weights are stored in.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from checkpoint_tools.errors import ConversionError
from checkpoint_tools.hf_folder import check_hf_tensors, copy_side_files, list_hf_tensors, load_config, weights_dtype
from checkpoint_tools.launch import (
    RankFailedError,
    agree_on_error,
    launched_by_torchrun,
    quiet_backend_warnings,
    run_ranks,
    shared_staging_dir,
)
from checkpoint_tools.output_dir import check_output_dir, discard, make_staging_dir, publish

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MODEL_SUBDIR = "model"
HF_SUBDIR = "hf"


@dataclass(frozen=True)
class HfToMegatronJob:
    """A checked conversion request: everything the ranks need."""

    hf_dir: Path
    out: Path
    tensor_parallel: int
    pipeline_parallel: int
    dtype: str  # "fp32" | "bf16"
    force: bool

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


def expected_hf_tensors(spec) -> dict[str, tuple[int, ...]]:
    """HF name → shape of every weight the model of ``spec`` has (from the one weight-mapping table)."""
    from dapo_megatron.policy.weight_mapping import ShardGeometry, full_model_mappings, hf_shapes

    geometry = ShardGeometry(spec, 1)
    return {name: shape for mapping in full_model_mappings(spec)
            for name, shape in zip(mapping.hf_names, hf_shapes(mapping, geometry), strict=True)}


def plan_hf_to_megatron(hf_dir: str | Path, out: str | Path, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                        dtype: str | None = None, force: bool = False) -> HfToMegatronJob:
    """Check the request reading no weight: config supported, layout possible, tensors complete, files sound."""
    from dapo_megatron.policy.model import (
        ParallelLayoutError,
        UnsupportedModelError,
        check_parallel_layout,
        model_spec_from_hf,
    )

    hf_dir, out = Path(hf_dir), Path(out)
    if not hf_dir.is_dir():
        raise ConversionError(f"--hf-dir {hf_dir} is not a directory")
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_output_dir(out, force=force, inputs=(hf_dir,))
    try:
        spec = model_spec_from_hf(load_config(hf_dir))
        check_parallel_layout(spec, tensor_parallel, pipeline_parallel)
    except (UnsupportedModelError, ParallelLayoutError) as exc:
        raise ConversionError(f"{hf_dir}: {exc}") from None
    expected = expected_hf_tensors(spec)
    stored = list_hf_tensors(hf_dir)
    check_hf_tensors(stored, expected, tie_embeddings=spec.tie_embeddings, where=hf_dir)
    if dtype is None:
        stored_dtype = weights_dtype(stored, expected)
        if stored_dtype not in DTYPE_NAMES:
            raise ConversionError(f"{hf_dir} stores its weights as {stored_dtype}: pass --dtype bf16 or --dtype fp32")
        dtype = DTYPE_NAMES[stored_dtype]
    return HfToMegatronJob(hf_dir, out, tensor_parallel, pipeline_parallel, dtype, force)


def _log(message: str) -> None:
    print(f"[hf_to_megatron] {message}", file=sys.stderr, flush=True)


def convert_on_rank(environ: Mapping[str, str] | None, job: HfToMegatronJob, staging: Path | None) -> None:
    """One rank's part: build this stage, read its HF slices, write its checkpoint shards; rank 0 publishes."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dapo_megatron.platform import init_distributed
    from dapo_megatron.policy.hf_loader import HFCheckpointError, load_hf_weights, load_model_spec
    from dapo_megatron.policy.model import build_model, transformer_config
    from dapo_megatron.trainer.checkpoint import save_model

    init_distributed(job.tensor_parallel, job.pipeline_parallel, environ=environ)
    staging = shared_staging_dir(staging, job.out)
    rank0 = dist.get_rank() == 0
    try:
        started = time.perf_counter()
        spec = load_model_spec(job.hf_dir)
        tconfig = transformer_config(spec, tensor_parallel=job.tensor_parallel,
                                     pipeline_parallel=job.pipeline_parallel, params_dtype=DTYPES[job.dtype],
                                     precision=job.dtype)
        tconfig.perform_initialization = False  # every parameter is loaded below; skip the random init
        model = build_model(spec, tconfig)
        try:
            load_hf_weights(model, spec, job.hf_dir)
        except HFCheckpointError as exc:
            raise ConversionError(str(exc)) from None
        if rank0:
            _log(f"read {job.hf_dir} at TP={job.tensor_parallel} PP={job.pipeline_parallel} "
                 f"({time.perf_counter() - started:.1f} s)")
        save_model([model], staging / MODEL_SUBDIR)
        del model
        error = None
        if rank0:
            try:
                copy_side_files(job.hf_dir, staging / HF_SUBDIR)
                publish(staging, job.out, force=job.force)
                _log(f"wrote {job.out} ({job.dtype}, {time.perf_counter() - started:.1f} s)")
            except (ConversionError, OSError) as exc:
                error = f"publishing {job.out} failed: {exc}"
        agree_on_error(error)
    except BaseException:
        if rank0:
            discard(staging)
        raise
    finally:
        parallel_state.destroy_model_parallel()


def convert_hf_to_megatron(hf_dir: str | Path, out: str | Path, *, tensor_parallel: int = 1,
                           pipeline_parallel: int = 1, dtype: str | None = None, force: bool = False) -> Path:
    """Check, then convert on ``tensor_parallel × pipeline_parallel`` ranks; returns ``out`` (or ConversionError)."""
    job = plan_hf_to_megatron(hf_dir, out, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                              dtype=dtype, force=force)
    if launched_by_torchrun():
        convert_on_rank(None, job, None)
        return job.out
    staging = make_staging_dir(job.out)
    try:
        run_ranks(convert_on_rank, job.world_size, job, staging)
    finally:
        discard(staging)  # already renamed to out on success
    return job.out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoint_tools.hf_to_megatron",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, type=Path, help="Hugging Face model folder (safetensors + config)")
    parser.add_argument("--out", required=True, type=Path, help="output folder (gets model/ and hf/)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks used for the conversion")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks used for the conversion")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="parameter dtype of the checkpoint (default: the dtype of the HF weights)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_backend_warnings()
    try:
        convert_hf_to_megatron(args.hf_dir, args.out, tensor_parallel=args.tp, pipeline_parallel=args.pp,
                               dtype=args.dtype, force=args.force)
    except ConversionError as exc:
        print(f"hf_to_megatron: error: {exc}", file=sys.stderr)
        return 2
    except RankFailedError as exc:
        print(f"hf_to_megatron: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # required: dist_checkpointing's writer spawns a Manager that re-imports __main__
    sys.exit(main())
