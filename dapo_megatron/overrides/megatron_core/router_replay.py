"""megatron-core 0.16.1's ``RouterReplay`` (``transformer/moe/router_replay.py``) keeps every target it is given.

``set_target_indices`` appends each micro-batch's int64 ``[tokens, k]`` target to ``replay_backward_list`` — the
queue REPLAY_BACKWARD pops when activation recomputation re-runs a router in backward — and only ``clear_indices``
empties it. Without recomputation nothing ever pops it, so a replayed pass kept every micro-batch's targets on the GPU
until it ended: ``tokens · layers · k · 8`` bytes per rank for its share of the pass, ~2 GB per GPU at the docs'
Qwen3-30B-A3B layout (issue 40, item 3). :func:`set_replay_target` gives a router its target and keeps it queued
for the recomputed forward only when one will come.
"""

from __future__ import annotations

from torch import Tensor


def set_replay_target(router_replay, indices: Tensor, *, kept_for_recompute: bool) -> None:
    """``router_replay.set_target_indices(indices)``; unless the forward will be recomputed in backward, without the
    copy megatron queues for REPLAY_BACKWARD (then only the current micro-batch's target is on the GPU)."""
    router_replay.set_target_indices(indices)
    if not kept_for_recompute:
        router_replay.replay_backward_list.pop()
