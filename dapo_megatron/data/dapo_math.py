"""Load DAPO-Math-17K (or any file in its schema, e.g. AIME-2024) into validated, deduplicated rows.

Sources:
- a local ``.parquet`` file: read with HF ``datasets`` (``Dataset.from_parquet``), iterated in arrow batches;
- a local folder: an HF ``datasets`` folder or a folder of parquet / jsonl shards (:mod:`.folders`), likewise;
- a local ``.jsonl`` file: parsed line by line with ``json`` so a malformed row is reported with its line number
  (arrow's JSON reader fails on a type mix with a column-level error that names no row);
- a hub name such as ``BytedTsinghua-SIA/DAPO-Math-17k`` when the path does not exist locally:
  ``datasets.load_dataset(name, split=...)`` (needs network; not exercised by the tests).

The public copy repeats each of its ~17k prompts about 100 times (1.79M rows). Rows are deduplicated by prompt text
(the ordered role/content pairs); the first occurrence is kept and every unique prompt carries its repeat count.
Two copies of one prompt with different ground truths are a validation error (or a counted skip of the later copy).
Nothing is dropped silently: every skipped row is counted by reason and logged.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal, Sequence

from dapo_megatron.data.schema import DapoRow, RowValidationError, validate_row
from dapo_megatron.user_errors import DataError

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

DAPO_MATH_HUB_NAME = "BytedTsinghua-SIA/DAPO-Math-17k"
OnBadRow = Literal["error", "skip"]
_ARROW_BATCH_ROWS = 8192
_LOGGED_SKIPS = 10


@dataclass(frozen=True)
class RawRow:
    """A row as read from the source, before validation. ``line`` is the 1-based jsonl line (None elsewhere)."""

    row: int
    line: int | None
    value: Any


@dataclass
class LoadReport:
    """Counts of what happened to the rows of one source. ``skipped_by_reason`` is keyed by the offending field."""

    source: str
    total_rows: int = 0
    valid_rows: int = 0
    unique_prompts: int = 0
    duplicate_rows: int = 0
    skipped_rows: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    max_repeats: int = 0

    def summary(self) -> str:
        mean_repeats = self.valid_rows / self.unique_prompts if self.unique_prompts else 0.0
        return (
            f"{self.source}: {self.total_rows} rows, {self.unique_prompts} unique prompts "
            f"({self.duplicate_rows} duplicate rows, repeats mean {mean_repeats:.2f} max {self.max_repeats}), "
            f"{self.skipped_rows} skipped {dict(sorted(self.skipped_by_reason.items()))}"
        )


@dataclass(frozen=True)
class DapoMathData:
    """Unique rows in first-seen order; ``repeat_counts[i]`` is how many source rows carried ``rows[i]``'s prompt."""

    rows: tuple[DapoRow, ...]
    repeat_counts: tuple[int, ...]
    report: LoadReport

    def __len__(self) -> int:
        return len(self.rows)

    def to_hf_dataset(self) -> "datasets.Dataset":
        """The unique rows as an HF ``Dataset`` in the published schema (for ``.map``/``.to_parquet`` users)."""
        import datasets

        return datasets.Dataset.from_list([row.to_schema_dict() for row in self.rows])


def _iter_jsonl(path: Path, *, on_bad_row: OnBadRow, report: LoadReport) -> Iterator[RawRow]:
    row = 0
    with path.open("rb") as handle:  # decoded line by line: a byte that is not UTF-8 is one bad row, not the file
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                report.total_rows += 1
                problem = RowValidationError(f"{path} (line {line_number})", row, "<utf-8>",
                                             f"not UTF-8 text (byte 0x{raw[error.start]:02x} at column "
                                             f"{error.start + 1})")
                _handle_bad_row(problem, on_bad_row=on_bad_row, report=report)
                row += 1
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                report.total_rows += 1
                problem = RowValidationError(f"{path} (line {line_number})", row, "<json>", f"not valid JSON: {error}")
                _handle_bad_row(problem, on_bad_row=on_bad_row, report=report)
                row += 1
                continue
            yield RawRow(row=row, line=line_number, value=value)
            row += 1


def _iter_arrow_dataset(dataset: "datasets.Dataset") -> Iterator[RawRow]:
    row = 0
    for batch in dataset.iter(batch_size=_ARROW_BATCH_ROWS):
        columns = list(batch)
        for values in zip(*(batch[name] for name in columns)):
            yield RawRow(row=row, line=None, value=dict(zip(columns, values)))
            row += 1


def iter_raw_rows(
    path_or_name: str | Path, *, split: str = "train", on_bad_row: OnBadRow = "error", report: LoadReport
) -> Iterator[RawRow]:
    """Raw rows of a local ``.jsonl``/``.parquet`` file or data folder (:mod:`.folders`), or of a hub dataset when no
    such local path exists."""
    path = Path(path_or_name)
    if path.is_dir():
        from dapo_megatron.data.folders import folder_dataset  # arrow: only folder sources need it

        return _iter_arrow_dataset(folder_dataset(path))
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet") and not path.exists():
        raise DataError(f"{path}: no such data file")
    if suffix in (".jsonl", ".json"):
        return _iter_jsonl(path, on_bad_row=on_bad_row, report=report)
    if path.exists() and suffix != ".parquet":
        raise DataError(f"{path}: unsupported file type {suffix!r}; expected .jsonl, .json or .parquet")
    import datasets  # only parquet and hub sources need arrow

    if suffix == ".parquet":
        if _parquet_rows(path) == 0:
            return iter(())  # datasets cannot load a parquet file without rows; load_dapo_math says it is empty
        try:
            dataset = datasets.Dataset.from_parquet(str(path))
        except Exception as error:  # pyarrow's errors name no file
            raise DataError(f"{path}: not a readable parquet file ({type(error).__name__}: {error})") from error
        return _iter_arrow_dataset(dataset)
    logger.info("%s is not a local path; loading it from the Hugging Face hub (split=%s)", path_or_name, split)
    return _iter_arrow_dataset(datasets.load_dataset(str(path_or_name), split=split))


def _parquet_rows(path: Path) -> int | None:
    """The row count a parquet file's footer records (None when it has no readable footer)."""
    import pyarrow.parquet as pq

    if path.stat().st_size == 0:
        return 0
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # noqa: BLE001 - not parquet: datasets' reader reports it
        return None


def _handle_bad_row(error: RowValidationError, *, on_bad_row: OnBadRow, report: LoadReport) -> None:
    if on_bad_row == "error":
        raise error
    report.skipped_rows += 1
    report.skipped_by_reason[error.field] = report.skipped_by_reason.get(error.field, 0) + 1
    if report.skipped_rows <= _LOGGED_SKIPS:
        logger.warning("skipping malformed row: %s", error)


def load_dapo_math(
    path_or_name: str | Path,
    *,
    integer_answers: bool = True,
    on_bad_row: OnBadRow = "error",
    split: str = "train",
) -> DapoMathData:
    """Read, validate and deduplicate one source in the DAPO-Math-17K schema.

    ``integer_answers`` requires every ground truth to be an integer literal (``-?\\d+``), as DAPO-Math-17K and
    AIME promise. ``on_bad_row="error"`` raises on the first malformed row; ``"skip"`` counts it under its field
    in ``report.skipped_by_reason`` and logs it.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    source = str(path_or_name)
    report = LoadReport(source=source)
    first_seen: dict[tuple[tuple[str, str], ...], int] = {}
    rows: list[DapoRow] = []
    rows_source_position: list[int] = []
    repeat_counts: list[int] = []
    for raw in iter_raw_rows(path_or_name, split=split, on_bad_row=on_bad_row, report=report):
        report.total_rows += 1
        where = source if raw.line is None else f"{source} (line {raw.line})"
        try:
            row = validate_row(raw.value, source=where, row=raw.row, integer_answers=integer_answers)
            position = first_seen.get(row.prompt_key)
            if position is not None and rows[position].ground_truth != row.ground_truth:
                raise RowValidationError(
                    where,
                    raw.row,
                    "reward_model.ground_truth",
                    f"{row.ground_truth!r} conflicts with {rows[position].ground_truth!r} given to the same prompt "
                    f"at row {rows_source_position[position]}",
                    index=row.index,
                )
        except RowValidationError as error:
            _handle_bad_row(error, on_bad_row=on_bad_row, report=report)
            continue
        report.valid_rows += 1
        if position is None:
            first_seen[row.prompt_key] = len(rows)
            rows.append(row)
            rows_source_position.append(raw.row)
            repeat_counts.append(1)
        else:
            repeat_counts[position] += 1
    report.unique_prompts = len(rows)
    report.duplicate_rows = report.valid_rows - report.unique_prompts
    report.max_repeats = max(repeat_counts, default=0)
    if report.total_rows == 0:
        raise DataError(f"{source}: the file has no rows")
    if not rows:
        raise DataError(f"{source}: none of its {report.total_rows} rows is usable (all skipped with "
                        f"data.on_bad_row=skip: {dict(sorted(report.skipped_by_reason.items()))})")
    logger.info("loaded %s", report.summary())
    if report.skipped_rows:
        logger.warning("%s: skipped %d malformed rows: %s", source, report.skipped_rows, report.skipped_by_reason)
    return DapoMathData(rows=tuple(rows), repeat_counts=tuple(repeat_counts), report=report)


def repeat_histogram(data: DapoMathData) -> dict[int, int]:
    """How many unique prompts were seen exactly n times, for each n (the public copy is ~100 for almost all)."""
    return dict(sorted(Counter(data.repeat_counts).items()))


def write_jsonl(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write schema rows (plain dicts) one JSON object per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_parquet(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write schema rows (plain dicts, one consistent type per field) as parquet via HF ``datasets``."""
    path = Path(path)
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(list(rows)).to_parquet(str(path))
    return path
