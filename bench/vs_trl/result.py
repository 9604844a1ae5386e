"""What both runners share (they run in different venvs, so this is plain Python): their command line and the
result file, one layout for both systems."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Callable


def write_result(path: str, system: str, versions: dict[str, str], steps: list[dict]) -> None:
    """Per-step records plus this process's torch threads and peak RSS (``ru_maxrss``), as JSON."""
    import torch

    result = {"system": system, "versions": {**versions, "torch": torch.__version__},
              "threads": torch.get_num_threads(), "steps": steps,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    Path(path).write_text(json.dumps(result, indent=1))


def run_from_argv(main: Callable[[str, str], None]) -> None:
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} WORKLOAD.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
