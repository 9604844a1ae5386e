"""SLURM's per-node task counts (``SLURM_TASKS_PER_NODE``, ``SLURM_NTASKS_PER_NODE``), read in two places: by the
trainer for its ranks on this node (:func:`dapo_megatron.launch_env.local_world_size`) and by the sbatch scripts'
launch plan (``slurm/launch_plan.py``, which runs under any ``python3``: this module needs the standard library only).
"""

from __future__ import annotations

import re

_PART = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def tasks_on_each_node(text: str) -> list[int]:
    """``"4(x2),3"`` → ``[4, 4, 3]``: SLURM's compressed list of task counts, one per node of the job.
    :class:`ValueError` naming ``text`` when it is not one."""
    per_node: list[int] = []
    for part in text.split(","):
        match = _PART.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"{text!r} is not a SLURM task count list (like 8, 8(x16) or 4(x2),3)")
        per_node += [int(match.group(1))] * int(match.group(2) or 1)
    return per_node
