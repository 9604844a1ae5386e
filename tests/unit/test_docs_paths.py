"""The README and docs/ name only module paths, folders and pages that exist, and the README links every docs/ page.

Code moves (issue 31 reorganised the package by concern) leave docs naming files that are gone; this scan catches
them. A path is read from inline code (`dapo_megatron/reward/scorer.py`, `python bench/ablation.py --seeds 3`): a
word with a slash that starts at one of the repository's source folders, or any word ending in ``.py`` — which must
then be written from the repository root. Fenced code blocks are commands and outputs, not references, and are not
scanned. Relative markdown links must lead to a file or folder of the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where the docs' references point; run outputs (runs/, run_dir/...) and metric names (actor/pg_loss) are not here.
SOURCE_FOLDERS = {"dapo_megatron", "checkpoint_tools", "tests", "bench", "scripts", "slurm", "examples", "docs",
                  "constraints", ".ci"}
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`([^`]+)`")
PATH_WORD = re.compile(r"^[\w.*-]+(?:/[\w.*-]+)*/?$")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def named_paths(markdown: str) -> list[str]:
    """The repository paths a page names in its inline code, in order."""
    paths = []
    for span in INLINE_CODE.findall(FENCE.sub("", markdown)):
        for word in re.split(r"[\s,;()\[\]]+", span):
            if "/" not in word or not PATH_WORD.match(word):
                continue
            if word.split("/", 1)[0] in SOURCE_FOLDERS or word.endswith(".py"):
                paths.append(word)
    return paths


def missing_references(markdown: str, page: Path) -> list[str]:
    """Every path (from the repository root) and relative link (from the page) on the page that leads nowhere."""
    missing = [path for path in named_paths(markdown) if not any(ROOT.glob(path.rstrip("/")))]
    for target in LINK.findall(FENCE.sub("", markdown)):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#", 1)[0]).exists():
            missing.append(target)
    return missing


def unlinked_pages(readme: str, pages: list[Path]) -> list[str]:
    """docs/ pages the README does not link to."""
    linked = {target.split("#", 1)[0] for target in LINK.findall(readme)}
    return [f"docs/{page.name}" for page in pages if f"docs/{page.name}" not in linked]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_named_path_and_link_exists(page):
    assert missing_references(page.read_text(), page) == []


def test_made_up_paths_and_links_are_reported():
    """Control: the scan finds what does not exist — including the reward path the old step maps named — and only
    that, in inline code, commands and links alike."""
    markdown = """
The reward is `dapo_megatron/reward/scorer.py` (not `dapo_megatron/algorithm/reward.py`), in `dapo_megatron/reward/`
and not `dapo_megatron/rewards/`; run `python bench/ablation.py --seeds 3` or `python bench/no_such_bench.py`;
`tests/integration/test_slurm_*.py`, `tests/integration/test_nothing_*.py`; a relative `reward/rule.py` must be
written from the root; `runs/tiny_cpu/metrics.jsonl` and `actor/pg_loss` are not repository paths.
See [the map](docs/architecture.md), [nothing](docs/no_such_page.md) and [a site](https://example.org/x.md).

```bash
python bench/not_checked_in_a_fence.py
```
"""
    assert missing_references(markdown, ROOT / "README.md") == [
        "dapo_megatron/algorithm/reward.py", "dapo_megatron/rewards/", "bench/no_such_bench.py",
        "tests/integration/test_nothing_*.py", "reward/rule.py", "docs/no_such_page.md"]


def test_the_readme_links_every_docs_page():
    assert unlinked_pages((ROOT / "README.md").read_text(), PAGES[1:]) == []


def test_a_docs_page_the_readme_does_not_link_is_reported():
    """Control for the test above."""
    readme = "[map](docs/architecture.md), [reward](docs/reward.md#your-function)"
    pages = [ROOT / "docs" / name for name in ("architecture.md", "reward.md", "scale.md")]
    assert unlinked_pages(readme, pages) == ["docs/scale.md"]
