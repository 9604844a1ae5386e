"""The built-in DAPO math rule in verl's per-sample form, for :class:`~dapo_megatron.reward.pool.RewardPool`'s worker
processes (``reward.builtin_in_workers``): the same rule the trainer runs in its own process by default
(:func:`dapo_megatron.reward.rule.math_reward`), moved off trainer rank 0.

Why it matters on a GPU: in rank 0's process the rule holds the GIL while rank 0 launches its TP/PP kernels, so
every other rank waits on it, and math-verify's per-answer timeout (``signal.alarm``) only works in a main thread,
which a worker's call runs in and the async collector's scoring thread is not.

Two functions, because a worker's target is a name, not a name plus settings: :func:`dapo_math` is the paper's exact
match, :func:`dapo_math_with_math_verify` adds the symbolic fallback (``algorithm.use_math_verify``).
"""

from __future__ import annotations

from dapo_megatron.reward.rule import math_reward

TARGETS = {False: f"{__name__}:dapo_math", True: f"{__name__}:dapo_math_with_math_verify"}


def dapo_math(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> dict:
    """``{"score": ±1, "acc": bool}`` of one response (one response per call, so that a response math-verify
    spends long on times out alone, not with its group)."""
    return _answer(solution_str, ground_truth, use_math_verify=False)


def dapo_math_with_math_verify(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> dict:
    """:func:`dapo_math` with math-verify's symbolic fallback."""
    return _answer(solution_str, ground_truth, use_math_verify=True)


def _answer(solution_str: str, ground_truth: str, *, use_math_verify: bool) -> dict:
    result = math_reward(solution_str, ground_truth, use_math_verify=use_math_verify)
    return {"score": result.score, "acc": result.acc}
