"""Checkpoints: the folder layout (:mod:`.layout`, megatron-free), whether one can be resumed from (:mod:`.verify`)
and saving/loading them with megatron-core's distributed checkpointing (:mod:`.save_load`; megatron is imported by
the functions that need it)."""

from dapo_megatron.checkpoint.layout import (
    COMPLETE_MARKER,
    CONFIG_FILE,
    DIST_CHECKPOINT_MARKER,
    HF_DIR,
    MODEL_DIR,
    OPTIMIZER_DIR,
    RNG_DIR,
    RUN_ID_FILE,
    TMP_SUFFIX,
    TRAINER_STATE_FILE,
    checkpoint_step,
    is_incomplete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    missing_checkpoint_files,
    rng_file,
    run_id_of,
    step_dir,
)
from dapo_megatron.checkpoint.save_load import (
    CheckpointError,
    load_checkpoint,
    load_model,
    model_sharded_state_dict,
    rng_state,
    save_checkpoint,
    save_model,
    set_rng_state,
)
from dapo_megatron.checkpoint.verify import (
    checkpoint_problems,
    checkpoint_to_resume,
    newest_sound_checkpoint,
    no_sound_checkpoint_error,
)

__all__ = [
    "COMPLETE_MARKER", "CONFIG_FILE", "DIST_CHECKPOINT_MARKER", "HF_DIR", "MODEL_DIR", "OPTIMIZER_DIR", "RNG_DIR",
    "RUN_ID_FILE", "TMP_SUFFIX", "TRAINER_STATE_FILE", "checkpoint_step", "is_incomplete_checkpoint",
    "latest_checkpoint", "list_checkpoints", "missing_checkpoint_files", "rng_file", "run_id_of", "step_dir",
    "CheckpointError", "load_checkpoint", "load_model", "model_sharded_state_dict", "rng_state", "save_checkpoint",
    "save_model", "set_rng_state", "checkpoint_problems", "checkpoint_to_resume", "newest_sound_checkpoint",
    "no_sound_checkpoint_error",
]
