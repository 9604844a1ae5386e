"""Checkpoints: the folder layout (:mod:`.layout`, megatron-free) and saving/loading them with megatron-core's
distributed checkpointing (:mod:`.save_load`; megatron is imported by the functions that need it)."""

from dapo_megatron.checkpoint.layout import (
    COMPLETE_MARKER,
    DIST_CHECKPOINT_MARKER,
    HF_DIR,
    MODEL_DIR,
    OPTIMIZER_DIR,
    RNG_DIR,
    TMP_SUFFIX,
    TRAINER_STATE_FILE,
    is_incomplete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    missing_checkpoint_files,
    rng_file,
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

__all__ = [
    "COMPLETE_MARKER", "DIST_CHECKPOINT_MARKER", "HF_DIR", "MODEL_DIR", "OPTIMIZER_DIR", "RNG_DIR", "TMP_SUFFIX",
    "TRAINER_STATE_FILE", "is_incomplete_checkpoint", "latest_checkpoint", "list_checkpoints",
    "missing_checkpoint_files", "rng_file", "step_dir",
    "CheckpointError", "load_checkpoint", "load_model", "model_sharded_state_dict", "rng_state", "save_checkpoint",
    "save_model", "set_rng_state",
]
