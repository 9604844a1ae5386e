"""Per-step scalars to ``metrics.jsonl`` and to the run's loggers (TensorBoard, W&B, MLflow: :mod:`.loggers`; the
same numbers in all), on rank 0 only.

Names follow verl's so curves can be compared across systems: ``actor/pg_loss``, ``actor/entropy``,
``critic/score/mean``, ``response_length/clip_ratio``, ``train/num_gen_batches``, ``val/<source>/acc/mean@k`` ...

``metrics.jsonl`` is appended to one row per step; a process killed while appending leaves a torn last line, which
readers skip with a warning and a resume drops (the file is rewritten atomically then).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from dapo_megatron.metrics.loggers import RunLogger, TensorBoardLogger

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    """``metrics.jsonl``, and ``loggers`` (:mod:`.loggers`: the generations file, TensorBoard, W&B, MLflow; default:
    TensorBoard when ``tensorboard``) for everything else."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, enabled: bool = True,
                 loggers: list[RunLogger] | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self._loggers: list[RunLogger] = []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._loggers = loggers if loggers is not None else [TensorBoardLogger(Path(run_dir))] if tensorboard else []

    def truncate_after(self, step: int) -> None:
        """On resume: drop lines of steps after the checkpoint (and torn lines), so the file reads as one
        uninterrupted run; the loggers drop theirs where they can."""
        if not self.enabled or not self.path.exists():
            return
        kept = [row for row in _parsed_rows(self.path) if row["step"] <= step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, self.path)
        for run_logger in self._loggers:
            run_logger.truncate_after(step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if v is not None else None) for k, v in sorted(scalars.items())}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **{k: (v if v is None or math.isfinite(v) else str(v))
                                                 for k, v in clean.items()}}) + "\n")
        for run_logger in self._loggers:
            run_logger.log_scalars(step, {k: v for k, v in clean.items() if v is not None})

    def log_generations(self, step: int, rows: list[dict]) -> None:
        """A validation's sample of generations (prompt, response, ground truth, score) at ``step``."""
        for run_logger in self._loggers if self.enabled else []:
            run_logger.log_generations(step, rows)

    def close(self) -> None:
        for run_logger in self._loggers:
            run_logger.close()
        self._loggers = []


def _parsed_rows(path: Path) -> list[dict]:
    """The rows of a metrics file; a line that is not a JSON object with a step (torn by a kill) is skipped with a
    warning naming it."""
    rows, torn = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError:
            torn.append(number)
            continue
        rows.append(row)
    if torn:
        logger.warning("%s: skipped line%s %s, not a whole metrics row (a write cut short by a kill?)", path,
                       "s" if len(torn) > 1 else "", ", ".join(map(str, torn)))
    return rows


def read_metrics(run_dir: str | Path) -> list[dict]:
    return _parsed_rows(Path(run_dir) / METRICS_FILE)
