"""Per-step scalars to TensorBoard and to ``metrics.jsonl`` (the same numbers in both), on rank 0 only.

Names follow verl's so curves can be compared across systems: ``actor/pg_loss``, ``actor/entropy``,
``critic/score/mean``, ``response_length/clip_ratio``, ``train/num_gen_batches``, ``val/<source>/acc/mean@k`` ...
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """On resume: drop lines of steps after the checkpoint, so the file reads as one uninterrupted run."""
        if not self.enabled or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if v is not None else None) for k, v in sorted(scalars.items())}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **{k: (v if v is None or math.isfinite(v) else str(v))
                                                 for k, v in clean.items()}}) + "\n")
        if self._tb is not None:
            for key, value in clean.items():
                if value is not None:
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
