"""Every module, class or function named in dotted form — in a docstring or comment of the package, tests, benchmarks
and tools (``dapo_megatron.rollout.multi_turn``, ``:class:`~dapo_megatron.reward.scorer.RewardScorer```, the relative
``:mod:`.loss``` of Sphinx roles), or in the README and docs/ — exists.

A reorganisation moves modules; docstrings that still name the old ones send a reader nowhere (issue 44 found 11).
A dotted name resolves when its longest prefix that is a module or package of the repository is followed by nothing,
by a name that module defines or imports at its top level (then whatever follows it: a method, an attribute), or by
a sub-folder. Slash paths in the docs are :mod:`test_docs_paths`' to check.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOTTED = re.compile(r"(?<![\w./-])dapo_megatron(?:\.[A-Za-z_]\w*)+")
RELATIVE_ROLE = re.compile(r":(?:mod|func|class|meth|data|attr|exc):`~?(\.+[A-Za-z_][\w.]*)`")
# Made-up names that the tests below and the import-layer test write on purpose.
EXAMPLES = {"tests/unit/test_docs_module_names.py", "tests/unit/test_import_layers.py",
            "tests/integration/test_backend.py"}


def code_files() -> list[Path]:
    files = [path for folder in ("dapo_megatron", "tests", "bench", "checkpoint_tools")
             for path in (ROOT / folder).rglob("*.py")]
    return [path for path in files if str(path.relative_to(ROOT)) not in EXAMPLES]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "dapo_megatron").rglob("*.md"))]


def module_file(parts: tuple[str, ...]) -> Path | None:
    path = ROOT.joinpath(*parts)
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


@cache
def top_level_names(path: Path) -> frozenset[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return frozenset(names)


def resolves(dotted: str) -> bool:
    parts = tuple(dotted.split("."))
    for end in range(len(parts), 0, -1):
        path = module_file(parts[:end])
        if path is None:
            continue
        rest = parts[end:]
        return not rest or rest[0] in top_level_names(path) or ROOT.joinpath(*parts[:end], rest[0]).is_dir()
    return False


def absolute(relative: str, source: Path) -> str:
    """``.loss`` in dapo_megatron/algorithm/objectives.py → ``dapo_megatron.algorithm.loss`` (one dot: this package,
    two: its parent, as Python's relative imports)."""
    dots = len(relative) - len(relative.lstrip("."))
    package = list(source.relative_to(ROOT).with_suffix("").parts[:-1])
    return ".".join(package[:len(package) - (dots - 1)] + relative.lstrip(".").split("."))


def unresolved(text: str, source: Path) -> list[str]:
    names = [match.rstrip(".") for match in DOTTED.findall(text)]
    if source.suffix == ".py" and source.is_relative_to(ROOT / "dapo_megatron"):
        names += [absolute(relative.rstrip("."), source) for relative in RELATIVE_ROLE.findall(text)]
    return [name for name in names if not resolves(name)]


def test_every_dotted_name_in_code_and_docs_exists():
    missing = {str(path.relative_to(ROOT)): found for path in code_files() + doc_files()
               if (found := unresolved(path.read_text(), path))}
    assert missing == {}


def test_names_of_moved_modules_are_reported():
    """Control: names the reorganisation removed are caught, as absolute names and as relative roles; real ones
    (a module, a package, a class and its method, a function a package imports) pass."""
    source = ROOT / "dapo_megatron" / "collectors" / "group.py"
    text = """
    :mod:`dapo_megatron.trainer.samples`, :func:`dapo_megatron.trainer.samples.corrected_samples`,
    :class:`~.rollout_collector.RolloutCollector`, :mod:`..rollout.memory`, dapo_megatron.policy.model.nothing_here.
    Real: :mod:`dapo_megatron.rollout`, :class:`~dapo_megatron.reward.scorer.RewardScorer`, :mod:`.sync`,
    :meth:`dapo_megatron.trainer.loop.DAPOTrainer.train_step`, :func:`dapo_megatron.checkpoint.save_checkpoint`.
    """
    assert unresolved(text, source) == [
        "dapo_megatron.trainer.samples", "dapo_megatron.trainer.samples.corrected_samples",
        "dapo_megatron.policy.model.nothing_here", "dapo_megatron.collectors.rollout_collector.RolloutCollector",
        "dapo_megatron.rollout.memory"]
