"""``trainer:``: the run's length and batch sizes, its directory and checkpoints, and where the metrics go."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dapo_megatron.config.errors import require, require_finite_numbers

# What the wandb project and the mlflow experiment are called unless the config names them.
_TRACKER_PROJECT = "dapo-megatron"


@dataclass
class WandbConfig:
    project: str = _TRACKER_PROJECT
    entity: str | None = None
    name: str | None = None  # default: the run directory's name
    # offline: files under run_dir/wandb, `wandb sync` them later. Unset: W&B's own setting decides (WANDB_MODE,
    # `wandb offline`; online when none).
    mode: Literal["online", "offline"] | None = None


@dataclass
class MlflowConfig:
    tracking_uri: str | None = None  # default: MLFLOW_TRACKING_URI when set, else sqlite:///<run_dir>/mlflow.db
    experiment: str = _TRACKER_PROJECT
    run_name: str | None = None  # default: the run directory's name


# Words with which a model revisits its own reasoning (the paper's "emergence of reflective reasoning").
REFLECTION_PHRASES = ("wait", "let me check", "let me verify", "recheck", "re-check", "double-check", "double check",
                      "reconsider", "re-evaluate", "mistake")


@dataclass
class TrainerConfig:
    total_steps: int = 100
    train_batch_size: int = 512  # groups (prompts) per step
    mini_batch_size: int = 32  # groups per optimizer update
    micro_batch_tokens: int = 32768  # packing budget per micro-batch
    seed: int = 42
    run_dir: str = "runs/dapo"
    save_every: int = 10  # 0: only at the end
    keep_checkpoints: int = 3  # of this run, the newest; 0: every one
    tensorboard: bool = True  # false removes tensorboard from `loggers`
    # Where the scalars go besides metrics.jsonl (dapo_megatron/metrics/loggers.py); wandb and mlflow are extras:
    # pip install -e '.[wandb]' / '.[mlflow]' in the clone.
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["tensorboard"])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    # A start in a run_dir that holds this run continues it, as --resume would (a fresh one starts from step 0), and
    # a restart by the launcher (torchrun --max-restarts, the SLURM scripts' requeue) is recorded in
    # run_dir/restarts.jsonl; a launcher's restart number past max_restarts is refused (dapo_megatron/run/restarts.py).
    auto_resume: bool = False
    max_restarts: int = 3
    # response/reflection_rate: the fraction of responses with one of these (case-insensitive, whole words)
    reflection_phrases: list[str] = field(default_factory=lambda: list(REFLECTION_PHRASES))

    def validate(self) -> None:
        require_finite_numbers(self, "trainer.")
        require(self.train_batch_size >= 1, "trainer.train_batch_size", f"must be >= 1, got {self.train_batch_size}")
        require(self.mini_batch_size >= 1, "trainer.mini_batch_size", f"must be >= 1, got {self.mini_batch_size}")
        require(self.train_batch_size % self.mini_batch_size == 0, "trainer.mini_batch_size",
                f"must divide trainer.train_batch_size ({self.train_batch_size}), got {self.mini_batch_size}")
        require(self.total_steps >= 0, "trainer.total_steps", "must be >= 0")
        require(self.keep_checkpoints >= 0, "trainer.keep_checkpoints",
                f"must be >= 0 (0 keeps every checkpoint), got {self.keep_checkpoints}")
        require(self.save_every >= 0, "trainer.save_every", f"must be >= 0 (0: only at the end), got {self.save_every}")
        require(self.micro_batch_tokens >= 1, "trainer.micro_batch_tokens", "must be >= 1")
        require(self.max_restarts >= 0, "trainer.max_restarts", f"must be >= 0, got {self.max_restarts}")
