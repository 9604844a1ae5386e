"""The table of dapo_megatron/overrides/README.md stays true: every module, fix and test it names exists, and its
"applied in" column is exactly the modules outside the folder that import it."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "dapo_megatron"
TABLE = PACKAGE / "overrides" / "README.md"
COLUMNS = ["fix", "what it does", "pinned", "applied in", "can it go?", "works"]


def table_rows(text: str) -> list[dict[str, str]]:
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == len(COLUMNS) and cells[0] not in ("fix", "---"):
            rows.append(dict(zip(COLUMNS, cells)))
    return rows


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def missing_tests(cell: str) -> list[str]:
    """The ``tests/...py[::name]`` references of ``cell`` whose file or test function does not exist."""
    missing = []
    for reference in code_spans(cell):
        if not reference.startswith("tests/"):
            continue
        path, _, name = reference.partition("::")
        file = REPO_ROOT / path
        if not file.is_file() or (name and not re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M)):
            missing.append(reference)
    return missing


def overrides_importers() -> set[str]:
    """Modules of the package outside overrides/ that import from it, relative to the package."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if (PACKAGE / "overrides") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            if any(name.startswith("dapo_megatron.overrides") for name in names):
                found.add(str(path.relative_to(PACKAGE)))
    return found


def test_every_fix_and_test_the_table_names_exists():
    rows = table_rows(TABLE.read_text())
    assert len(rows) >= 11
    for row in rows:
        module, *names = code_spans(row["fix"])
        imported = importlib.import_module("dapo_megatron.overrides." + module.removesuffix(".py").replace("/", "."))
        assert names and all(hasattr(imported, name) for name in names), row["fix"]
        assert missing_tests(row["can it go?"] + row["works"]) == [], row["fix"]
        assert row["can it go?"].startswith(("`tests/", "goes with", "not by a pin move")), row["fix"]
    # control: a test that does not exist, or a file that does not, is caught
    assert missing_tests("`tests/unit/test_overrides_table.py::test_not_here` `tests/unit/nothing.py`") == [
        "tests/unit/test_overrides_table.py::test_not_here", "tests/unit/nothing.py"]


def test_the_applied_in_column_is_every_module_that_imports_an_override():
    listed = {span for row in table_rows(TABLE.read_text()) for span in code_spans(row["applied in"])
              if span.endswith(".py")}
    importers = overrides_importers()
    assert importers == listed
    # control: the scan is not empty-handed — it sees a function-local import (cli.py) and a top-level one
    assert {"cli.py", "policy/actor.py"} <= importers
