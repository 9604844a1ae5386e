"""What a command reads, checked before anything expensive (warm start, the policy, servers) is built from it.

``train`` and ``eval`` call :func:`check_run_inputs` on global rank 0 through
:func:`dapo_megatron.rank_zero.run_on_rank0`, right after the process group is up, so a bad input is one
:class:`~dapo_megatron.user_errors.UserError` on every rank within seconds:

* the user's model folder (``model.source = hf``): :func:`dapo_megatron.trainer.model_source.check_model_folder`,
  whether it splits over ``parallel.tensor`` × ``parallel.pipeline``, and, for training, whether its estimated
  memory (:mod:`dapo_megatron.policy.memory`) fits what a GPU has — or, on CPU, what this host has for the trainer
  ranks it runs (:func:`check_training_memory`);
* the data files and ``data.train`` sources (``data.source = dapo_math``): read and validated, every row (the trainer
  reuses what was read; a large folder read as drawn: its columns and first rows);
* ``reward.function``: imported, its form read from its signature (:mod:`dapo_megatron.reward.function`);
* ``trainer.loggers``: their libraries installed (:func:`dapo_megatron.trainer.loggers.check_logger_libraries`);
* the checkpoint a command starts from: ``train --resume`` the newest complete one under the run directory (none
  is fine: the run starts at step 0), ``eval --ckpt`` the one named.
"""

from __future__ import annotations

from pathlib import Path

from dapo_megatron.backend import Backend
from dapo_megatron.checkpoint import MODEL_DIR, CheckpointError, latest_checkpoint, missing_checkpoint_files
from dapo_megatron.config import ConfigError, DAPOConfig
from dapo_megatron.hf_format import INDEX_FILE, SINGLE_FILE
from dapo_megatron.trainer.loggers import check_logger_libraries
from dapo_megatron.trainer.model_source import check_model_folder


def check_run_inputs(config: DAPOConfig, *, world_size: int, backend: Backend, resume: bool = False,
                     checkpoint: str | Path | None = None) -> None:
    """Raise the :class:`~dapo_megatron.user_errors.UserError` of the first bad input (see the module docstring).
    ``checkpoint``: the one ``eval`` reads (then nothing is trained, so the training memory is not checked)."""
    if config.model.source == "hf":
        spec = check_user_model(config)
        if checkpoint is None:
            check_training_memory(config, spec, world_size=world_size, fused_attention=backend.uses_transformer_engine)
    check_data_files(config)
    check_reward_function(config)
    if checkpoint is None:
        check_logger_libraries(config)
    if resume:
        check_resume_checkpoint(Path(config.trainer.run_dir) / "checkpoints", world_size)
    if checkpoint is not None:
        check_model_checkpoint(Path(checkpoint))


def check_user_model(config: DAPOConfig):
    """The user's model folder, checked; returns its :class:`~dapo_megatron.policy.model.ModelSpec`."""
    from dapo_megatron.policy.model_spec import ParallelLayoutError, check_parallel_layout

    spec = check_model_folder(config.model.hf_path, tokenizer_path=config.model.tokenizer_path)
    p = config.parallel
    try:
        check_parallel_layout(spec, p.tensor, p.pipeline)
    except ParallelLayoutError as error:
        raise ConfigError(f"parallel.tensor={p.tensor} / parallel.pipeline={p.pipeline} do not fit the model in "
                          f"{config.model.hf_path}: {error}") from None
    return spec


# A CPU rank's own cost besides its share of the model (Python, torch, megatron-core), measured at ~0.6-0.9 GB RSS
# for a tiny model; it replaces the GPU plan's fixed CUDA-context margin on CPU.
CPU_PROCESS_BYTES = 10**9


def check_training_memory(config: DAPOConfig, spec, *, world_size: int, fused_attention: bool,
                          available: tuple[int, str] | None = None) -> None:
    """Refuse a layout whose estimated training memory exceeds what is there, naming both numbers.

    On GPU every rank has its own device: the largest stage's estimate must fit one GPU. On CPU the trainer ranks of
    this host share its memory: the largest stage's estimate (without the GPU plan's CUDA margin, plus a process's
    own cost) times the ranks on this host must fit the host's RAM. ``fused_attention``: the backend runs Transformer
    Engine's. ``available``: (bytes, what they are), for tests; default: this machine's."""
    import torch

    from dapo_megatron.platform import local_world_size
    from dapo_megatron.policy.memory import plan_stages

    p = config.parallel
    data_parallel = max(world_size // (p.tensor * p.pipeline), 1)
    stages, _ = plan_stages(config, spec, data_parallel=data_parallel, local_spec=not fused_attention)
    largest = max(stages, key=lambda stage: stage.total_bytes)
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        need, ranks = largest.total_bytes, 1
    else:
        ranks = min(local_world_size(), world_size)
        need = ranks * (largest.total_bytes - largest.margin_bytes + CPU_PROCESS_BYTES)
    have, what = available or _available_memory(on_gpu)
    if need > have:
        per = f"{ranks} trainer ranks on this host × " if ranks > 1 else ""
        raise ConfigError(
            f"model.hf_path: training {config.model.hf_path} ({spec.num_layers} layers, hidden {spec.hidden_size}, "
            f"vocab {spec.vocab_size}) at TP={p.tensor} PP={p.pipeline} DP={data_parallel} in "
            f"{config.model.precision} needs an estimated {need / 2**30:.1f} GiB ({per}pipeline stage "
            f"{largest.stage}: `dapo-megatron plan` breaks it down), but {what} has {have / 2**30:.1f} GiB")


def _available_memory(on_gpu: bool) -> tuple[int, str]:
    import psutil
    import torch

    if on_gpu:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory, f"GPU {torch.cuda.current_device()} ({props.name})"
    return psutil.virtual_memory().total, "this host"


def check_data_files(config: DAPOConfig) -> None:
    from dapo_megatron.trainer.task import check_training_data

    check_training_data(config)


def check_reward_function(config: DAPOConfig) -> None:
    """``reward.function`` imports here, in this process, and has one of the forms (its workers start later)."""
    from dapo_megatron.reward.function import RewardFunctionError, load_reward_function, reward_form

    target = config.reward.function
    if target:
        try:
            reward_form(load_reward_function(target), target)
        except RewardFunctionError as error:
            raise ConfigError(f"reward.function: {error}") from None


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
