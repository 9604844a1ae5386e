"""What every conversion does the same way: check the request, run on every rank, and publish the output whole.

A conversion is a :class:`ConversionJob`: the checked request (output, layout, dtypes) plus the three steps that
differ between the tools — fill this rank's model (:meth:`~ConversionJob.fill`), write this rank's part of the output
(:meth:`~ConversionJob.write_rank_part`), and write what rank 0 adds once every part is in
(:meth:`~ConversionJob.write_rank0_files`). :func:`convert_on_rank` is the per-rank skeleton around them; every
rank builds its pipeline stage of the model uninitialized (every parameter is loaded), the output is assembled in a
staging folder that is published (renamed into place) only when every rank succeeded, and the same error reaches
every rank when one fails.
"""

from __future__ import annotations

import abc
import argparse
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping

import torch

from checkpoint_tools.errors import ConversionError
from checkpoint_tools.launch import (
    RankFailedError,
    agree_on_error,
    launched_by_torchrun,
    quiet_backend_warnings,
    run_ranks,
    shared_staging_dir,
)
from dapo_megatron.config.model import Kernels
from dapo_megatron.hf_format import CONFIG_FILE, HFFormatError, discard, load_hf_config, publish, staging_dir


@contextmanager
def bad_input() -> Iterator[None]:
    """Errors that mean the input cannot be converted, as :class:`ConversionError` (the CLIs' exit status 2)."""
    from dapo_megatron.checkpoint import CheckpointError

    try:
        yield
    except (HFFormatError, CheckpointError) as exc:
        raise ConversionError(str(exc)) from None


def checked_spec(config_dir: Path, tensor_parallel: int, pipeline_parallel: int, expert_parallel: int = 1):
    """The model spec of ``config_dir``'s config, after checking the model is supported at this layout."""
    from dapo_megatron.policy.model_spec import (
        ParallelLayoutError,
        UnsupportedModelError,
        check_parallel_layout,
        model_spec_from_hf,
    )

    with bad_input():
        config = load_hf_config(config_dir)
    try:
        spec = model_spec_from_hf(config)
        check_parallel_layout(spec, tensor_parallel, pipeline_parallel, expert_parallel)
    except (UnsupportedModelError, ParallelLayoutError) as exc:
        raise ConversionError(f"{config_dir / CONFIG_FILE}: {exc}") from None
    return spec


def check_output_dir(out: Path, *, force: bool, inputs: tuple[Path, ...]) -> None:
    """Refuse an existing ``out`` (unless ``force``) and any ``out`` that is, contains or lies inside an input."""
    resolved = out.resolve()
    for source in inputs:
        source = source.resolve()
        if resolved == source or source.is_relative_to(resolved) or resolved.is_relative_to(source):
            raise ConversionError(f"output {out} overlaps the input {source}: choose another --out")
    if out.exists() and not force:
        raise ConversionError(f"output {out} already exists (pass --force to replace it)")
    if out.exists() and not out.is_dir():
        raise ConversionError(f"output {out} exists and is not a directory")


@dataclass(frozen=True)
class ConversionJob(abc.ABC):
    """A checked conversion request: everything the ranks need (picklable: it travels to spawned ranks)."""

    out: Path
    tensor_parallel: int
    pipeline_parallel: int
    expert_parallel: int  # a MoE model's experts over this many ranks (the conversion's data-parallel ranks)
    force: bool

    tool: ClassVar[str]  # the module name, for log lines and CLI errors
    kernels: ClassVar[Kernels] = "auto"  # the policy's layers, as model.kernels picks them (dapo_megatron.backend)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.expert_parallel

    @property
    @abc.abstractmethod
    def input_dir(self) -> Path:
        """What is read (for log lines)."""

    @property
    @abc.abstractmethod
    def config_dir(self) -> Path:
        """The HF folder whose config.json the model is built from."""

    @property
    @abc.abstractmethod
    def params_dtype(self) -> torch.dtype:
        """The dtype of the model's parameters."""

    @property
    @abc.abstractmethod
    def written_dtype(self) -> torch.dtype:
        """The dtype of the written weights (for log lines)."""

    def adapt(self, model) -> None:
        """Change the built stage before it is filled (LoRA exports add the adapters); nothing by default."""

    @abc.abstractmethod
    def fill(self, model, spec) -> None:
        """Load this rank's parameters from the input."""

    @abc.abstractmethod
    def write_rank_part(self, model, spec, staging: Path) -> Any:
        """Write this rank's part of the output into ``staging``; what it returns is gathered on rank 0."""

    @abc.abstractmethod
    def write_rank0_files(self, staging: Path, parts: list) -> None:
        """On rank 0, once every part is written: the files that complete the output."""


def log(tool: str, message: str) -> None:
    print(f"[{tool}] {message}", file=sys.stderr, flush=True)


def convert_on_rank(environ: Mapping[str, str] | None, job: ConversionJob, staging: Path | None) -> None:
    """One rank's part: build this stage, fill it, write its part; rank 0 completes and publishes the output."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dapo_megatron.backend_registry import select_backend
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.policy.model import build_model, transformer_config
    from dapo_megatron.policy.model_spec import model_spec_from_hf

    backend = init_distributed(job.tensor_parallel, job.pipeline_parallel, expert_parallel=job.expert_parallel,
                               backend=select_backend(job.kernels), environ=environ).backend
    staging = shared_staging_dir(staging, job.out)
    rank0 = dist.get_rank() == 0
    try:
        started = time.perf_counter()
        with bad_input():
            spec = model_spec_from_hf(load_hf_config(job.config_dir))
        precision = "bf16" if job.params_dtype == torch.bfloat16 else "fp32"
        tconfig = transformer_config(spec, backend, tensor_parallel=job.tensor_parallel,
                                     pipeline_parallel=job.pipeline_parallel, params_dtype=job.params_dtype,
                                     precision=precision, expert_parallel=job.expert_parallel)
        tconfig.perform_initialization = False  # every parameter is loaded below; skip the random init
        model = build_model(spec, tconfig, backend)
        job.adapt(model)
        with bad_input():
            job.fill(model, spec)
        if rank0:
            log(job.tool, f"read {job.input_dir} at TP={job.tensor_parallel} PP={job.pipeline_parallel} "
                          f"EP={job.expert_parallel} "
                          f"({time.perf_counter() - started:.1f} s)")
        part = job.write_rank_part(model, spec, staging)
        del model
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, part)
        error = None
        if rank0:
            try:
                job.write_rank0_files(staging, parts)
                publish(staging, job.out, replace=job.force)
                log(job.tool, f"wrote {job.out} ({str(job.written_dtype).removeprefix('torch.')}, "
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


def run_conversion(job: ConversionJob) -> Path:
    """Run ``job`` on its ``tensor_parallel × pipeline_parallel × expert_parallel`` ranks (this process is one under
    torchrun);
    returns ``job.out`` (or raises ConversionError / RankFailedError)."""
    if launched_by_torchrun():
        convert_on_rank(None, job, None)
        return job.out
    staging = staging_dir(job.out)
    try:
        run_ranks(convert_on_rank, job.world_size, job, staging)
    finally:
        discard(staging)  # already renamed to out on success
    return job.out


def conversion_parser(tool: str, doc: str, *, input_arguments: Callable[[argparse.ArgumentParser], None],
                      out_help: str, dtypes: Mapping[str, torch.dtype], dtype_help: str) -> argparse.ArgumentParser:
    """The command line of a conversion CLI (``python -m checkpoint_tools.<tool>``, described by the first paragraph
    of its module ``doc``): what it reads (``input_arguments`` adds those), then what every conversion takes —
    ``--out``, the ``--tp``/``--pp``/``--ep`` layout, ``--dtype`` (one of ``dtypes``) and ``--force``."""
    parser = argparse.ArgumentParser(prog=f"python -m checkpoint_tools.{tool}", description=doc.split("\n\n")[0])
    input_arguments(parser)
    parser.add_argument("--out", required=True, type=Path, help=out_help)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks used for the conversion")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks used for the conversion")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel ranks used for the conversion (MoE models; the world is TP×PP×EP)")
    parser.add_argument("--dtype", choices=sorted(dtypes), default=None, help=dtype_help)
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    return parser


def conversion_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments every ``convert_*`` function takes, from :func:`conversion_parser`'s arguments."""
    return {"tensor_parallel": args.tp, "pipeline_parallel": args.pp, "expert_parallel": args.ep,
            "dtype": args.dtype, "force": args.force}


def run_cli(tool: str, convert: Callable[[], object]) -> int:
    """Exit status of a conversion CLI: 0 done, 2 bad input (one line naming what is wrong), 1 a rank failed."""
    quiet_backend_warnings()
    try:
        convert()
    except (ConversionError, RankFailedError) as exc:
        print(f"{tool}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConversionError) else 1
    return 0
