"""``data:``: the training prompts (DAPO-Math-17K-schema files, a weighted mixture of sources, or the synthetic
task) and the validation problems."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dapo_megatron.config.errors import require, require_finite_numbers


@dataclass
class ScratchpadDataConfig:
    """``data.synthetic.scratchpad``: the number of terms per chain, drawn uniformly from min_terms..max_terms."""

    min_terms: int = 2
    max_terms: int = 12

    def validate(self) -> None:
        require(self.min_terms >= 2, "data.synthetic.scratchpad.min_terms", f"must be >= 2, got {self.min_terms}")
        require(self.max_terms >= self.min_terms, "data.synthetic.scratchpad.max_terms",
                f"must be >= min_terms ({self.min_terms}), got {self.max_terms}")


@dataclass
class SyntheticDataConfig:
    """The integer-answer synthetic task (the CPU demo)."""

    seed: int = 0
    num_train: int = 4000
    num_heldout: int = 300
    # arith: chains and products (data/synthetic.py); tools: problems to solve with the python tool
    # (data/synthetic_tools.py, examples/tiny_cpu_tools.yaml); scratchpad: chains of min_terms..max_terms numbers, one
    # working line per term, so response lengths spread widely (data/synthetic_scratchpad.py, the ablation's task).
    mode: Literal["arith", "tools", "scratchpad"] = "arith"
    scratchpad: ScratchpadDataConfig = field(default_factory=ScratchpadDataConfig)

    def validate(self) -> None:
        """Called by :meth:`DataConfig.validate`."""
        require(self.num_train >= 1, "data.synthetic.num_train", f"must be >= 1, got {self.num_train}")
        require(self.num_heldout >= 0, "data.synthetic.num_heldout", f"must be >= 0, got {self.num_heldout}")
        require(self.mode in ("arith", "tools", "scratchpad"), "data.synthetic.mode",
                f"must be arith, tools or scratchpad, got {self.mode!r}")
        self.scratchpad.validate()


@dataclass
class TrainSourceConfig:
    """One training source of a mixture (``data.train``): a parquet / jsonl file in the DAPO-Math-17K (verl) schema,
    a folder written by HF ``datasets``' ``save_to_disk``, or a folder of parquet / jsonl shards."""

    path: str = ""
    weight: float = 1.0  # share of the prompts drawn = weight / sum of the weights
    name: str | None = None  # what per-source metrics call it; default: its rows' data_source

    def validate(self, key: str) -> None:
        """Called by :meth:`DataConfig.validate`; ``key``: where this source sits (``data.train[2]``)."""
        require(bool(self.path), f"{key}.path", "is required")
        require(self.weight > 0, f"{key}.weight", f"must be > 0, got {self.weight}")


@dataclass
class DataConfig:
    source: Literal["dapo_math", "synthetic"] = "dapo_math"
    train_files: list[str] = field(default_factory=list)  # parquet / jsonl in the DAPO-Math-17K schema: one pool
    # Several sources mixed by weight (dapo_megatron/data/mixture.py); instead of train_files.
    train: list[TrainSourceConfig] = field(default_factory=list)
    # A folder source with more rows than this is read when drawn (memory-mapped arrow, rows validated as drawn, no
    # deduplication) instead of being loaded, validated and deduplicated at start.
    stream_above_rows: int = 200_000
    val_files: list[str] = field(default_factory=list)  # e.g. AIME-2024 in the same schema
    max_prompt_length: int = 2048
    on_bad_row: Literal["error", "skip"] = "error"
    integer_answers: bool = True
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)

    def validate(self) -> None:
        require_finite_numbers(self, "data.")
        require(self.max_prompt_length >= 1, "data.max_prompt_length", f"must be >= 1, got {self.max_prompt_length}")
        self.synthetic.validate()
        require(self.source == "synthetic" or bool(self.train_files) or bool(self.train), "data.train_files",
                "(or data.train) is required when data.source = dapo_math")
        require(not (self.train_files and self.train), "data.train",
                "and data.train_files are two ways to give the training data: use one")
        require(not self.train or self.source == "dapo_math", "data.train", "needs data.source = dapo_math")
        for i, source in enumerate(self.train):
            source.validate(f"data.train[{i}]")
        require(self.stream_above_rows >= 0, "data.stream_above_rows", "must be >= 0")
