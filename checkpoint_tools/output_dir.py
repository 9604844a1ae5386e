"""The output folder appears whole or not at all.

Everything is written into a hidden staging folder next to the output (``.<name>.tmp-XXXX``, same filesystem) and
renamed into place at the very end, so an interrupted or failed conversion never leaves a folder at ``out`` that
looks valid. An existing ``out`` is refused unless ``force``; with ``force`` it is renamed aside and deleted only
after the new folder is in place.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from checkpoint_tools.errors import ConversionError


def check_output_dir(out: Path, *, force: bool, inputs: tuple[Path, ...]) -> None:
    """Refuse an existing ``out`` (unless ``force``) and any ``out`` that is, contains or lies inside an input."""
    resolved = out.resolve()
    for source in inputs:
        source = source.resolve()
        if resolved == source or source.is_relative_to(resolved) or resolved.is_relative_to(source):
            raise ConversionError(f"output {out} overlaps the input {source}: choose another --out")
    if out.exists() and not force:
        raise ConversionError(f"output {out} already exists (pass --force to replace it)")
    if out.exists() and not out.is_dir():
        raise ConversionError(f"output {out} exists and is not a directory")


def make_staging_dir(out: Path) -> Path:
    """A fresh hidden folder next to ``out`` to build the output in."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))


def _default_dir_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def publish(staged: Path, out: Path, *, force: bool) -> None:
    """Rename the finished ``staged`` folder to ``out`` (replacing an existing one only when ``force``).

    Temporary folders are created private (mode 0700); the published one gets the mode a plain ``mkdir`` would.
    """
    staged.chmod(_default_dir_mode())
    if not out.exists():
        staged.rename(out)
        return
    if not force:
        raise ConversionError(f"output {out} appeared while converting (pass --force to replace it)")
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    staged.rename(out)
    shutil.rmtree(old)


def discard(staging: Path | None) -> None:
    """Remove a staging folder (after a failure); nothing happens when it was already published or never made."""
    if staging is not None and staging.exists():
        shutil.rmtree(staging, ignore_errors=True)
