"""What a command reads, checked before anything expensive (warm start, the policy, servers) is built from it.

``train`` and ``eval`` call :func:`check_run_inputs` on global rank 0 through
:func:`dapo_megatron.rank_zero.run_on_rank0`, right after the process group is up, so a bad input is one
:class:`~dapo_megatron.user_errors.UserError` on every rank within seconds:

* the user's model folder (``model.source = hf``): :func:`dapo_megatron.trainer.model_source.check_model_folder`,
  and whether it splits over ``parallel.tensor`` × ``parallel.pipeline``;
* the data files (``data.source = dapo_math``): read and validated, every row (the trainer reuses what was read);
* the checkpoint a command starts from: ``train --resume`` the newest complete one under the run directory (none
  is fine: the run starts at step 0), ``eval --ckpt`` the one named.
"""

from __future__ import annotations

from pathlib import Path

from dapo_megatron.checkpoint import MODEL_DIR, CheckpointError, latest_checkpoint, missing_checkpoint_files
from dapo_megatron.config import ConfigError, DAPOConfig
from dapo_megatron.hf_format import INDEX_FILE, SINGLE_FILE
from dapo_megatron.trainer.model_source import check_model_folder


def check_run_inputs(config: DAPOConfig, *, world_size: int, resume: bool = False,
                     checkpoint: str | Path | None = None) -> None:
    """Raise the :class:`~dapo_megatron.user_errors.UserError` of the first bad input (see the module docstring)."""
    if config.model.source == "hf":
        check_user_model(config)
    check_data_files(config)
    if resume:
        check_resume_checkpoint(Path(config.trainer.run_dir) / "checkpoints", world_size)
    if checkpoint is not None:
        check_model_checkpoint(Path(checkpoint))


def check_user_model(config: DAPOConfig) -> None:
    from dapo_megatron.policy.model import ParallelLayoutError, check_parallel_layout

    spec = check_model_folder(config.model.hf_path, tokenizer_path=config.model.tokenizer_path)
    p = config.parallel
    try:
        check_parallel_layout(spec, p.tensor, p.pipeline)
    except ParallelLayoutError as error:
        raise ConfigError(f"parallel.tensor={p.tensor} / parallel.pipeline={p.pipeline} do not fit the model in "
                          f"{config.model.hf_path}: {error}") from None


def check_data_files(config: DAPOConfig) -> None:
    from dapo_megatron.trainer.task import load_data_file

    if config.data.source != "dapo_math":
        return
    for path in [*config.data.train_files, *config.data.val_files]:
        load_data_file(config, path)


def check_resume_checkpoint(root: Path, world_size: int) -> None:
    path = latest_checkpoint(root)
    if path is None:
        return
    missing = missing_checkpoint_files(path, world_size)
    if missing:
        raise CheckpointError(f"--resume: {path} is marked complete but lacks {', '.join(missing)}"
                              + (" (written by a different number of ranks?)" if any("rng/" in m for m in missing)
                                 else ""))


def check_model_checkpoint(path: Path) -> None:
    """``eval --ckpt``: a trainer checkpoint or a checkpoint_tools output (``model/`` is what is read)."""
    if not path.is_dir():
        raise CheckpointError(f"--ckpt {path}: no such directory")
    if not (path / MODEL_DIR).is_dir():
        hint = (f" (it is an HF folder: a run with model.source=hf model.hf_path={path} trainer.total_steps=0 "
                f"evaluates it)"
                if (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file() else "")
        raise CheckpointError(f"--ckpt {path}: no {MODEL_DIR}/ folder, so not a trainer or checkpoint_tools "
                              f"checkpoint{hint}")
    missing = [name for name in missing_checkpoint_files(path, world_size=0) if name.startswith(MODEL_DIR)]
    if missing:
        raise CheckpointError(f"--ckpt {path}: lacks {', '.join(missing)} (a checkpoint still being written, or "
                              f"not a megatron-core distributed checkpoint)")
