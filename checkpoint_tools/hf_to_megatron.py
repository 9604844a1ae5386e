"""Hugging Face folder → megatron-core distributed checkpoint, loadable by the trainer at any TP/PP (and EP).

    python -m checkpoint_tools.hf_to_megatron --hf-dir DIR --out DIR --tp N --pp M [--ep E] [--dtype bf16|fp32]
                                              [--force]

Output layout (the same as a trainer checkpoint's ``model/`` and ``hf/``; :mod:`dapo_megatron.checkpoint.layout`)::

    <out>/model/   megatron-core distributed checkpoint, exactly what ``dapo_megatron.checkpoint.save_model``
                   writes; ``dapo_megatron.checkpoint.load_model`` loads it at any TP/PP (tensors are stored with
                   global shapes)
    <out>/hf/      config.json, generation_config.json and tokenizer files copied from the HF folder

How: the input is checked from safetensors headers first (names, shapes, file integrity; see
:mod:`dapo_megatron.hf_format`). Then N×M ranks each build their pipeline stage's ``GPTModel`` (uninitialized:
every parameter is overwritten), read only their slice of each HF tensor (:func:`dapo_megatron.policy.hf_loader.
load_hf_weights`) and write their shards with ``dist_checkpointing``. Peak memory per rank is about its own share
of the model (1/(N·M) of it) plus one tensor slice being read; no rank ever holds the full state dict.

A mixture-of-experts model (Qwen3-MoE) may also split its experts over ``--ep`` E ranks: N·M·E ranks, each reading
only its own experts.

Ranks come from ``torchrun`` when RANK/WORLD_SIZE are set (the world may then be N·M·DP), else N·M·E processes are
spawned here (gloo on CPU, NCCL with one GPU per rank). The checkpoint's parameter dtype is ``--dtype``, by default
the dtype the HF weights are stored in.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint_tools.driver import (
    ConversionJob,
    bad_input,
    check_output_dir,
    checked_spec,
    conversion_options,
    conversion_parser,
    run_cli,
    run_conversion,
)
from checkpoint_tools.errors import ConversionError
from dapo_megatron.checkpoint.layout import HF_DIR, MODEL_DIR
from dapo_megatron.hf_format import CONFIG_FILE, StoredTensor, compare_shapes, copy_side_files, list_tensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class HfToMegatronJob(ConversionJob):
    hf_dir: Path
    dtype: str  # "fp32" | "bf16"

    tool = "hf_to_megatron"

    @property
    def input_dir(self) -> Path:
        return self.hf_dir

    @property
    def config_dir(self) -> Path:
        return self.hf_dir

    @property
    def params_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def written_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def fill(self, model, spec) -> None:
        from dapo_megatron.policy.hf_loader import load_hf_weights

        load_hf_weights(model, spec, self.hf_dir)

    def write_rank_part(self, model, spec, staging: Path) -> None:
        from dapo_megatron.checkpoint import save_model

        save_model([model], staging / MODEL_DIR)

    def write_rank0_files(self, staging: Path, parts: list) -> None:
        copy_side_files(self.hf_dir, staging / HF_DIR)


def expected_hf_tensors(spec) -> dict[str, tuple[int, ...]]:
    """HF name → shape of every weight the model of ``spec`` has (from the one weight-mapping table)."""
    from dapo_megatron.policy.weight_mapping import ShardGeometry, full_model_mappings, hf_shapes

    geometry = ShardGeometry(spec, 1)
    return {name: shape for mapping in full_model_mappings(spec)
            for name, shape in zip(mapping.hf_names, hf_shapes(mapping, geometry), strict=True)}


def _not_a_weight(name: str, tie_embeddings: bool) -> bool:
    """Stored tensors that are not weights of the model: RoPE buffers, and a tied model's copy of the embedding."""
    return name.endswith("rotary_emb.inv_freq") or (tie_embeddings and name == "lm_head.weight")


def check_hf_tensors(stored: dict[str, StoredTensor], expected: dict[str, tuple[int, ...]], *,
                     tie_embeddings: bool, where: Path) -> None:
    """Exactly the ``expected`` names with the expected shapes, else one error listing every problem by name."""
    mismatch = compare_shapes({name: t.shape for name, t in stored.items()}, expected,
                              where=lambda name: stored[name].file,
                              ignore_unexpected=lambda name: _not_a_weight(name, tie_embeddings))
    if mismatch:
        raise ConversionError(mismatch.report(f"{where} does not match its {CONFIG_FILE}"))


def weights_dtype(stored: dict[str, StoredTensor], expected: dict[str, tuple[int, ...]]) -> torch.dtype:
    """The one dtype every weight is stored in (an error when they differ)."""
    dtypes = {stored[n].torch_dtype for n in expected}
    if len(dtypes) != 1:
        raise ConversionError(f"the weights are stored in several dtypes ({sorted(map(str, dtypes))}): pass --dtype")
    return dtypes.pop()


def plan_hf_to_megatron(hf_dir: str | Path, out: str | Path, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                        expert_parallel: int = 1, dtype: str | None = None, force: bool = False) -> HfToMegatronJob:
    """Check the request reading no weight: config supported, layout possible, tensors complete, files sound."""
    hf_dir, out = Path(hf_dir), Path(out)
    if not hf_dir.is_dir():
        raise ConversionError(f"--hf-dir {hf_dir} is not a directory")
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_output_dir(out, force=force, inputs=(hf_dir,))
    spec = checked_spec(hf_dir, tensor_parallel, pipeline_parallel, expert_parallel)
    expected = expected_hf_tensors(spec)
    with bad_input():
        stored = list_tensors(hf_dir)
    check_hf_tensors(stored, expected, tie_embeddings=spec.tie_embeddings, where=hf_dir)
    if dtype is None:
        stored_dtype = weights_dtype(stored, expected)
        if stored_dtype not in DTYPE_NAMES:
            raise ConversionError(f"{hf_dir} stores its weights as {stored_dtype}: pass --dtype bf16 or --dtype fp32")
        dtype = DTYPE_NAMES[stored_dtype]
    return HfToMegatronJob(out=out, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                           expert_parallel=expert_parallel, force=force, hf_dir=hf_dir, dtype=dtype)


def convert_hf_to_megatron(hf_dir: str | Path, out: str | Path, *, tensor_parallel: int = 1,
                           pipeline_parallel: int = 1, expert_parallel: int = 1, dtype: str | None = None,
                           force: bool = False) -> Path:
    """Check, then convert on ``tensor_parallel × pipeline_parallel × expert_parallel`` ranks; returns ``out`` (or
    ConversionError)."""
    return run_conversion(plan_hf_to_megatron(hf_dir, out, tensor_parallel=tensor_parallel,
                                              pipeline_parallel=pipeline_parallel, expert_parallel=expert_parallel,
                                              dtype=dtype, force=force))


def build_parser() -> argparse.ArgumentParser:
    def input_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--hf-dir", required=True, type=Path,
                            help="Hugging Face model folder (safetensors + config)")

    return conversion_parser(HfToMegatronJob.tool, __doc__, input_arguments=input_arguments,
                             out_help="output folder (gets model/ and hf/)", dtypes=DTYPES,
                             dtype_help="parameter dtype of the checkpoint (default: the dtype of the HF weights)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(HfToMegatronJob.tool, lambda: convert_hf_to_megatron(args.hf_dir, args.out,
                                                                        **conversion_options(args)))


if __name__ == "__main__":  # required: dist_checkpointing's writer spawns a Manager that re-imports __main__
    sys.exit(main())
