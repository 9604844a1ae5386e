"""Per-step scalars to ``metrics.jsonl`` and to the run's loggers (TensorBoard, W&B, MLflow: :mod:`.loggers`; the
same numbers in all), on rank 0 only.

Names follow verl's so curves can be compared across systems: ``actor/pg_loss``, ``actor/entropy``,
``critic/score/mean``, ``response_length/clip_ratio``, ``train/num_gen_batches``, ``val/<source>/acc/mean@k`` ...
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dapo_megatron.trainer.loggers import RunLogger, TensorBoardLogger


class MetricsWriter:
    """``metrics.jsonl``, and ``loggers`` (:mod:`.loggers`: the generations file, TensorBoard, W&B, MLflow; default:
    TensorBoard when ``tensorboard``) for everything else."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, enabled: bool = True,
                 loggers: list[RunLogger] | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._loggers: list[RunLogger] = []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._loggers = loggers if loggers is not None else [TensorBoardLogger(Path(run_dir))] if tensorboard else []

    def truncate_after(self, step: int) -> None:
        """On resume: drop lines of steps after the checkpoint, so the file reads as one uninterrupted run."""
        if not self.enabled or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))
        for logger in self._loggers:
            logger.truncate_after(step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if v is not None else None) for k, v in sorted(scalars.items())}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **{k: (v if v is None or math.isfinite(v) else str(v))
                                                 for k, v in clean.items()}}) + "\n")
        for logger in self._loggers:
            logger.log_scalars(step, {k: v for k, v in clean.items() if v is not None})

    def log_generations(self, step: int, rows: list[dict]) -> None:
        """A validation's sample of generations (prompt, response, ground truth, score) at ``step``."""
        for logger in self._loggers if self.enabled else []:
            logger.log_generations(step, rows)

    def close(self) -> None:
        for logger in self._loggers:
            logger.close()
        self._loggers = []


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
