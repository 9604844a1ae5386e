"""The import graph of dapo_megatron/ (issue 31, item 4): no circle between modules, and the backend seam at the
bottom — backend/ names nothing of the layers that use it.

Read from the sources (ast), so every import counts, the ones inside functions too (an arrow all the same, only paid
later); imports under ``if TYPE_CHECKING:`` are left out (they never run). An arrow goes to the module an import
names: ``from a.b import c`` to ``a.b.c`` when that is a module, else to ``a.b``; ``import a.b.c`` to the longest of
``a.b.c``, ``a.b``, ``a`` that is one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dapo_megatron"

# What uses the backend; backend/ must not import it back.
ABOVE_THE_BACKEND = ("policy", "handoff", "rollout", "trainer", "collectors", "run", "metrics", "cpu", "cuda",
                     "backend_registry", "tools", "commands")
# The registry knows every backend; the concrete CUDA backends pick the policy's layers and THD packer and the
# handoff's process-group gather (as cpu/backend.py does for CPU). The rest of backend/ is what they all implement.


def package_sources(package: Path = PACKAGE) -> tuple[dict[str, str], set[str]]:
    """(module name -> source, the names that are packages) of every module under ``package``."""
    sources, packages = {}, set()
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
            packages.add(".".join(parts))
        sources[".".join(parts)] = path.read_text()
    return sources, packages


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _known(name: str, modules) -> str | None:
    """The longest prefix of the dotted ``name`` that is one of ``modules``."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def runtime_imports(source: str, module: str, modules, *, is_package: bool = False) -> set[str]:
    """The modules of ``modules`` that ``module`` (whose ``source`` this is) imports when it runs."""
    found: set[str] = set()
    home = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(_known(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = home[:len(home) - node.level + 1] if node.level else []
            origin = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else _known(origin, modules))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found - {None, module}


def import_graph(sources: dict[str, str], packages=frozenset()) -> dict[str, set[str]]:
    return {module: runtime_imports(source, module, sources, is_package=module in packages)
            for module, source in sources.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan's algorithm), each as the modules in it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return circles


def arrows_up_from_the_backend(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every import of a layer above the backend by a module of ``dapo_megatron/backend/`` (the
    concrete backends and the registry that names them live above: cpu/, cuda/, backend_registry.py)."""
    above = tuple(f"dapo_megatron.{folder}" for folder in ABOVE_THE_BACKEND)
    return sorted(f"{module} -> {target}" for module, targets in graph.items()
                  if (module == "dapo_megatron.backend" or module.startswith("dapo_megatron.backend."))
                  for target in targets if any(target == a or target.startswith(a + ".") for a in above))


def test_no_import_circle_between_modules():
    sources, packages = package_sources()
    assert len(sources) > 100  # the whole package was read
    assert import_circles(import_graph(sources, packages)) == []


def test_control_a_circle_is_found_also_through_a_function_level_import():
    sources = {
        "dapo_megatron.a": "from dapo_megatron.b import f\n",
        "dapo_megatron.b": "def f():\n    from dapo_megatron import c\n",
        "dapo_megatron.c": "import dapo_megatron.a\nfrom typing import TYPE_CHECKING\n",
        "dapo_megatron.d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dapo_megatron.a import x\n",
        "dapo_megatron.e": "from .a import x\n",
    }
    graph = import_graph(sources)
    assert graph["dapo_megatron.d"] == set()  # a TYPE_CHECKING import is no arrow
    assert graph["dapo_megatron.e"] == {"dapo_megatron.a"}  # a relative import is resolved
    assert import_circles(graph) == [["dapo_megatron.a", "dapo_megatron.b", "dapo_megatron.c"]]
    del sources["dapo_megatron.b"]
    assert import_circles(import_graph(sources)) == []


def folder_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of the graph of ``dapo_megatron``'s folders (and top-level modules): ``a -> b`` when a module of
    ``a`` imports one of ``b``. None means the folders stack in layers: no import runs back up."""
    def folder(module: str) -> str:
        return module.split(".")[1] if module.count(".") >= 1 else module

    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module.startswith("dapo_megatron."):
            folders.setdefault(folder(module), set()).update(
                folder(t) for t in targets if t.startswith("dapo_megatron.") and folder(t) != folder(module))
    return import_circles(folders)


def test_the_folders_stack_in_layers():
    sources, packages = package_sources()
    assert folder_circles(import_graph(sources, packages)) == []


def test_control_a_folder_circle_is_found():
    sources, packages = package_sources()
    sources["dapo_megatron.config.extra"] = "from dapo_megatron.reward.rule import math_reward\n"
    assert ["config", "reward"] in folder_circles(import_graph(sources, packages))  # reward imports config


def test_the_backend_imports_nothing_of_what_uses_it():
    sources, packages = package_sources()
    graph = import_graph(sources, packages)
    assert arrows_up_from_the_backend(graph) == []
    # the registry does import what it registers, so the check does look at real imports
    assert "dapo_megatron.cpu.backend" in graph["dapo_megatron.backend_registry"]


ARROWS_BACK_UP = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from dapo_megatron.trainer.loop import DAPOTrainer  # no arrow: never runs


def later():
    from dapo_megatron.policy import packing
"""


def test_control_an_arrow_back_up_from_the_backend_is_reported():
    sources, packages = package_sources()
    sources["dapo_megatron.backend.base"] += ARROWS_BACK_UP
    sources["dapo_megatron.backend.extra"] = "from ..handoff.tp_gather import ProcessGroupGather\n"
    assert arrows_up_from_the_backend(import_graph(sources, packages)) == [
        "dapo_megatron.backend.base -> dapo_megatron.policy.packing",
        "dapo_megatron.backend.extra -> dapo_megatron.handoff.tp_gather",
    ]
