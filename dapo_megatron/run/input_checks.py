"""What a command reads, checked before anything expensive (warm start, the policy, servers) is built from it.

``train`` and ``eval`` call :func:`check_run_inputs` on global rank 0 through
:func:`dapo_megatron.rank_zero.run_on_rank0`, right after the process group is up, so a bad input is one
:class:`~dapo_megatron.user_errors.UserError` on every rank within seconds:

* the user's model folder (``model.source = hf``): :func:`dapo_megatron.run.model_source.check_model_folder`,
  whether it splits over ``parallel.tensor`` × ``parallel.pipeline``, and, for training, whether its estimated
  memory (:mod:`dapo_megatron.policy.memory.gpu`) fits what a GPU has — or, on CPU, what this host has for the trainer
  ranks it runs (:func:`check_training_memory`); whether a step's host memory on rank 0's node fits
  ``parallel.host_memory_gb`` (:func:`check_host_memory`); with ``rollout.engine: embedded``, whether the engine's
  fp32 host copy fits this host next to its trainer ranks (:func:`check_embedded_engine_memory`);
* the data files and ``data.train`` sources (``data.source = dapo_math``): read and validated, every row (the trainer
  reuses what was read; a large folder read as drawn: its columns and first rows); enough distinct training prompts
  for a step's draws (:func:`check_enough_prompts`; once more after the prompts longer than
  ``data.max_prompt_length`` are dropped, by :func:`dapo_megatron.data.task.train_prompts`);
* ``reward.function``: imported, its form read from its signature (:mod:`dapo_megatron.reward.function`);
* ``trainer.loggers``: their libraries installed (:func:`dapo_megatron.metrics.loggers.check_logger_libraries`);
* the checkpoint a command starts from: ``train --resume`` the newest complete one under the run directory without
  missing or truncated files (:func:`dapo_megatron.checkpoint.newest_sound_checkpoint`; none is fine: the run starts
  at step 0), written with the settings this run has where they cannot change (:mod:`.config_record`), at a step no
  later than ``trainer.total_steps``; ``eval --ckpt`` the one named.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dapo_megatron.backend.base import Backend
from dapo_megatron.checkpoint import (
    CONFIG_FILE,
    MODEL_DIR,
    CheckpointError,
    checkpoint_step,
    missing_checkpoint_files,
    newest_sound_checkpoint,
    no_sound_checkpoint_error,
)
from dapo_megatron.config import ConfigError, DAPOConfig
from dapo_megatron.hf_format import INDEX_FILE, SINGLE_FILE
from dapo_megatron.metrics.loggers import check_logger_libraries
from dapo_megatron.run.model_source import check_model_folder
from dapo_megatron.run.config_record import check_resume_config, read_config_file
from dapo_megatron.data.task import check_enough_prompts, check_training_data, load_data_file, train_files_summary


def check_run_inputs(config: DAPOConfig, *, world_size: int, backend: Backend, resume: bool = False,
                     checkpoint: str | Path | None = None) -> None:
    """Raise the :class:`~dapo_megatron.user_errors.UserError` of the first bad input (see the module docstring).
    ``checkpoint``: the one ``eval`` reads (then nothing is trained, so the training memory is not checked)."""
    check_rollout_routing(config, backend)
    spec = check_user_model(config) if config.model.source == "hf" else None
    if checkpoint is None:
        check_training_layout(config, spec, backend)
    if spec is not None:
        if checkpoint is None:
            check_training_memory(config, spec, world_size=world_size, fused_attention=backend.uses_transformer_engine)
            check_host_memory(config, spec, world_size=world_size, backend=backend)
        if config.rollout.engine == "embedded":
            check_embedded_engine_memory(config, spec, world_size=world_size, backend=backend)
    check_data_files(config)
    check_reward_function(config)
    if checkpoint is None:
        check_logger_libraries(config)
    if resume:
        check_resume(config, world_size)
    if checkpoint is not None:
        check_model_checkpoint(Path(checkpoint))


def check_user_model(config: DAPOConfig):
    """The user's model folder, checked; returns its :class:`~dapo_megatron.policy.model.ModelSpec`."""
    from dapo_megatron.policy.model_spec import ParallelLayoutError, check_parallel_layout

    spec = check_model_folder(config.model.hf_path, tokenizer_path=config.model.tokenizer_path)
    p = config.parallel
    try:
        check_parallel_layout(spec, p.tensor, p.pipeline, p.expert)
    except ParallelLayoutError as error:
        raise ConfigError(f"parallel.tensor={p.tensor} / parallel.pipeline={p.pipeline} / parallel.expert={p.expert} "
                          f"do not fit the model in {config.model.hf_path}: {error}") from None
    if spec.moe is None and config.algorithm.moe_routing_replay != "none":
        raise ConfigError(f"algorithm.moe_routing_replay={config.algorithm.moe_routing_replay} needs a "
                          f"mixture-of-experts model; {config.model.hf_path} is {spec.arch}")
    return spec


def check_rollout_routing(config: DAPOConfig, backend: Backend) -> None:
    """R3 on SGLang servers of this platform: SGLang 0.5.23's CPU server cannot capture routing (its routed-experts
    host buffer registers itself with CUDA, ``pool_host/common.py``, and the server dies at start)."""
    if (config.algorithm.moe_routing_replay == "replay_rollout" and config.rollout.engine == "sglang"
            and backend.device_type == "cpu"):
        raise ConfigError("algorithm.moe_routing_replay: replay_rollout with rollout.engine: sglang needs CUDA "
                          "servers: SGLang 0.5.23's CPU server cannot capture routing (its routed-experts buffer "
                          "registers with CUDA at start); use rollout.engine: embedded on CPU")


def check_training_layout(config: DAPOConfig, spec, backend: Backend) -> None:
    """A layout megatron-core accepts at build time but refuses in the first update (after a whole rollout): a
    mixture-of-experts model at TP > 1 without sequence parallelism. ``spec``: the user's model; None for
    ``model.source = tiny``, whose model is made later (the warm start) and is a MoE when ``model.tiny.arch`` says
    so."""
    from dapo_megatron.policy.model import require_sequence_parallel_for_moe_training, sequence_parallel_enabled

    p, te = config.parallel, backend.uses_transformer_engine
    require_sequence_parallel_for_moe_training(
        has_experts=spec.moe is not None if spec is not None else config.model.tiny.arch == "qwen3_moe",
        tensor_parallel=p.tensor, use_transformer_engine=te,
        sequence_parallel=sequence_parallel_enabled(p.sequence_parallel, tensor_parallel=p.tensor,
                                                    use_transformer_engine=te))


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

    from dapo_megatron.launch_env import local_world_size

    p = config.parallel
    data_parallel = max(world_size // (p.tensor * p.pipeline), 1)
    on_gpu = torch.cuda.is_available()
    largest = _largest_stage(config, spec, world_size=world_size, fused_attention=fused_attention)
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


def check_host_memory(config: DAPOConfig, spec, *, world_size: int, backend: Backend,
                      available: tuple[int, str] | None = None, ranks_on_node: int | None = None) -> None:
    """Refuse a step whose host memory on rank 0's node — routing replay's routing, a colocated optimizer's state
    moved there (:mod:`dapo_megatron.policy.memory.host`, at the length limits) — exceeds ``parallel.host_memory_gb``
    (unset: this node's memory), naming both numbers. ``available`` ((bytes, what they are)), ``ranks_on_node``: for
    tests; default: the budget, and the trainer ranks on this node."""
    import psutil

    from dapo_megatron.launch_env import local_world_size
    from dapo_megatron.policy.memory.host import host_memory
    from dapo_megatron.policy.memory.gpu import plan_stages
    from dapo_megatron.rollout.gpu_sharing import optimizer_offloading_ranks

    p = config.parallel
    data_parallel = max(world_size // (p.tensor * p.pipeline), 1)
    stages, sequence_parallel = plan_stages(config, spec, data_parallel=data_parallel,
                                            local_spec=not backend.uses_transformer_engine)
    ranks = min(local_world_size(), world_size) if ranks_on_node is None else ranks_on_node
    memory = host_memory(config, spec, stages, data_parallel=data_parallel, sequence_parallel=sequence_parallel,
                         ranks_per_node=ranks, offloading_ranks=optimizer_offloading_ranks(
                             config, ranks_on_node=ranks, on_gpu=backend.device_type == "cuda"))
    if available is None:
        available = ((int(p.host_memory_gb * 1e9), "parallel.host_memory_gb") if p.host_memory_gb is not None
                     else (psutil.virtual_memory().total, "this node"))
    have, what = available
    if memory.first_node_bytes > have:
        raise ConfigError(
            f"parallel.host_memory_gb: a step of this run may need {memory.first_node_bytes / 1e9:.1f} GB of host "
            f"memory on rank 0's node ({ranks} ranks; routing replay "
            f"{config.algorithm.moe_routing_replay} and the optimizer state colocated ranks move there, at the length "
            f"limits: `dapo-megatron plan` breaks it down), but {what} has {have / 1e9:.1f} GB")


def _largest_stage(config: DAPOConfig, spec, *, world_size: int, fused_attention: bool):
    from dapo_megatron.policy.memory.gpu import plan_stages

    p = config.parallel
    data_parallel = max(world_size // (p.tensor * p.pipeline), 1)
    stages, _ = plan_stages(config, spec, data_parallel=data_parallel, local_spec=not fused_attention)
    return max(stages, key=lambda stage: stage.total_bytes)


def check_embedded_engine_memory(config: DAPOConfig, spec, *, world_size: int, backend: Backend,
                                 available_host_bytes: int | None = None, ranks_on_host: int | None = None) -> None:
    """Refuse ``rollout.engine: embedded`` when its fp32 host copy (:mod:`dapo_megatron.rollout.embedded.memory`)
    and the trainer ranks of this host do not fit the host memory available now, naming every number. The trainer
    ranks' host share: a process's own cost on GPU; on CPU their stage's estimate too (as
    :func:`check_training_memory`). ``available_host_bytes``, ``ranks_on_host``: for tests; default: this machine's."""
    import psutil

    from dapo_megatron.launch_env import local_world_size
    from dapo_megatron.rollout.embedded.memory import embedded_engine_bytes, embedded_parameters

    engine = embedded_engine_bytes(spec, config.rollout.embedded)
    ranks = min(local_world_size(), world_size) if ranks_on_host is None else ranks_on_host
    per_rank = CPU_PROCESS_BYTES
    if backend.device_type == "cpu":
        largest = _largest_stage(config, spec, world_size=world_size, fused_attention=False)
        per_rank += largest.total_bytes - largest.margin_bytes
    need = sum(engine.values()) + ranks * per_rank
    have = psutil.virtual_memory().available if available_host_bytes is None else available_host_bytes
    if need <= have:
        return
    gib = 2**30
    where = "on its CPU (the GPUs only train)" if backend.device_type == "cuda" else "on its CPU"
    raise ConfigError(
        f"rollout.engine=embedded keeps an fp32 copy of {config.model.hf_path} "
        f"({embedded_parameters(spec) / 1e9:.2f}B parameters: {engine['weights'] / gib:.1f} GiB) and its KV cache and "
        f"logits ({(engine['kv_cache'] + engine['logits']) / gib:.1f} GiB, rollout.embedded) in rank 0's host memory "
        f"and decodes {where}; with {ranks} trainer rank(s) on this host ({ranks * per_rank / gib:.1f} GiB) that is "
        f"{need / gib:.1f} GiB, but this host has {have / gib:.1f} GiB available: use rollout.engine=sglang")


def _available_memory(on_gpu: bool) -> tuple[int, str]:
    import psutil
    import torch

    if on_gpu:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory, f"GPU {torch.cuda.current_device()} ({props.name})"
    return psutil.virtual_memory().total, "this host"


def check_data_files(config: DAPOConfig) -> None:
    d = config.data
    if d.source == "synthetic":
        check_enough_prompts(config, d.synthetic.num_train, "data.synthetic.num_train")
        return
    check_training_data(config)  # every file and data.train source read and checked
    if d.train_files:
        check_enough_prompts(config, sum(len(load_data_file(config, path)) for path in d.train_files),
                             train_files_summary(config))


def check_reward_function(config: DAPOConfig) -> None:
    """``reward.function`` imports here, in this process, and has one of the forms (its workers start later);
    ``algorithm.use_math_verify`` finds math-verify (in a worker, its absence would only show as errors per
    response)."""
    from dapo_megatron.reward.function import RewardFunctionError, load_reward_function, reward_form

    if config.algorithm.use_math_verify and importlib.util.find_spec("math_verify") is None:
        raise ConfigError("algorithm.use_math_verify needs the optional 'math-verify' package: "
                          "pip install -e '.[math-verify]' (in the dapo-megatron clone)")
    fraction = config.reward.max_error_fraction
    if not 0 <= fraction <= 1:
        raise ConfigError(f"reward.max_error_fraction: must be between 0 and 1 (1: never stop), got {fraction:g}")
    target = config.reward.function
    if target:
        try:
            reward_form(load_reward_function(target), target)
        except RewardFunctionError as error:
            raise ConfigError(f"reward.function: {error}") from None


def check_resume(config: DAPOConfig, world_size: int) -> None:
    """``train --resume``: a checkpoint to continue from, if any, that this config may continue."""
    run_dir = Path(config.trainer.run_dir)
    path, passed_over = newest_sound_checkpoint(run_dir / "checkpoints", world_size)
    if path is None:
        if passed_over:
            raise no_sound_checkpoint_error(passed_over)
        return
    previous = read_config_file(path / CONFIG_FILE) or read_config_file(run_dir / CONFIG_FILE)
    if previous is not None:
        check_resume_config(previous, config, where=f"the run in {run_dir} (checkpoint {path.name})")
    step = checkpoint_step(path)
    if config.trainer.total_steps < step:
        raise ConfigError(f"trainer.total_steps={config.trainer.total_steps} is below the step of the checkpoint "
                          f"--resume continues from ({path}, step {step}): set it to {step} or more, or evaluate "
                          f"that checkpoint with `dapo-megatron eval --ckpt {path}`")


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
