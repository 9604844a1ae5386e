"""Who may write into a run directory, and when ``train`` may start a run there.

``train`` claims its run directory (:func:`claim_run_directory`, on global rank 0, before anything is built) and holds
it until the process ends:

* the directory's lock (:mod:`.lock`): a second ``train`` (or ``prepare-tiny`` into it) is refused while the
  first lives, whichever node it runs on;
* a directory that already holds a run — checkpoints, or logged metrics — is continued with ``--resume``, or moved
  aside whole with ``--overwrite`` (to ``<run_dir>.replaced-<UTC time>``, next to it: nothing is deleted); without
  either, ``train`` refuses with a config error naming what is there.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

from dapo_megatron.checkpoint import list_checkpoints
from dapo_megatron.config import ConfigError
from dapo_megatron.metrics.writer import METRICS_FILE, read_metrics
from dapo_megatron.run.lock import LOCK_FILE, RunLock

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"


def existing_run(run_dir: str | Path) -> str | None:
    """What shows that ``run_dir`` holds a run (checkpoints, complete or not; metrics rows), or None."""
    run_dir = Path(run_dir)
    found = []
    checkpoints = run_dir / CHECKPOINTS_DIR
    if checkpoints.is_dir() and any(child.name.startswith("step_") for child in checkpoints.iterdir()):
        complete = list_checkpoints(checkpoints)
        newest = f", the newest {complete[-1].name}" if complete else ""
        found.append(f"{len(complete)} complete checkpoints{newest}")
    if (run_dir / METRICS_FILE).is_file():
        rows = read_metrics(run_dir)
        if rows:
            found.append(f"{len(rows)} metrics rows up to step {rows[-1].get('step')}")
    return "; ".join(found) or None


def move_run_aside(run_dir: str | Path) -> Path:
    """Move everything in ``run_dir`` but its lock to a new folder next to it; returns that folder."""
    run_dir = Path(run_dir)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
    suffix = 1
    while aside.exists():
        suffix += 1
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}-{suffix}")
    aside.mkdir()
    for child in sorted(run_dir.iterdir()):
        if child.name != LOCK_FILE:
            os.rename(child, aside / child.name)
    return aside


# A full disk or quota, a read-only mount, no permission: the run could write nothing there (other OSErrors are
# not the directory's state, and keep their traceback)
UNWRITABLE = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def _free_space(run_dir: Path) -> str:
    existing = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)
    try:
        free = shutil.disk_usage(existing).free if existing is not None else None
    except OSError:
        free = None
    return "" if free is None else f" ({free / 2**20:.1f} MiB free there)"


def claim_run_directory(run_dir: str | Path, *, resume: bool, overwrite: bool) -> RunLock:
    """Lock ``run_dir`` (made if missing) for this process, and make it ready for a new run unless ``resume``: an
    earlier run in it is moved aside with ``overwrite``, else refused. Returns the held lock."""
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other: continue the run in trainer.run_dir, or "
                          "move it aside and start a new one")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir).acquire()
    except OSError as error:
        if error.errno not in UNWRITABLE:
            raise
        raise ConfigError(f"trainer.run_dir: cannot write in {run_dir}: {error.strerror or error}"
                          f"{_free_space(run_dir)}") from None
    try:
        found = None if resume else existing_run(run_dir)
        if found and not overwrite:
            raise ConfigError(f"trainer.run_dir: {run_dir} holds a run ({found}); pass --resume to continue it, "
                              f"--overwrite to move it aside and start a new one, or choose another trainer.run_dir")
        if found:
            aside = move_run_aside(run_dir)
            logger.warning("--overwrite: the run that was in %s (%s) is now in %s", run_dir, found, aside)
    except BaseException:
        lock.release()
        raise
    return lock
