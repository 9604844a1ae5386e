"""Dynamic sampling: keep only prompt groups with mixed outcomes until a full batch is collected (DAPO §3.2).

A group is the G responses sampled for one prompt. It is kept iff

    0 < |{i : acc_i}| < G

i.e. some but not all of its responses are correct. All-correct and all-wrong groups have identical rewards, hence
zero advantages and zero gradient, so they are dropped. The decision uses the correctness ``acc``, never the shaped
score (the overlong penalty must not make an all-correct group look mixed) — as the reference recipe filters on
``acc``.

The buffer is generic: a group is any object the trainer defines, exposing its per-response correctness as an
attribute ``accs`` (a sequence of bool: list, tuple or bool tensor) or, for plain dict groups, a key ``"accs"``.
Groups are stored as they are and returned in arrival order.

Surplus: one generation round usually overshoots the target. ``surplus_policy="drop"`` discards the extra groups,
which is what verl's DAPO trainer does (it truncates the batch to the target) and the trainer's default unless a
rollout correction is on. ``"keep"`` holds them for the next step — no generation is wasted, but those groups were
sampled by weights one version older than the policy that trains on them: off-policy samples, which the trainer
counts as stale (``train/stale_group_fraction``) and corrects when ``algorithm.rollout_correction`` is on.

``filter_groups=False`` turns dynamic sampling off (the ablation): every group is kept, and the statistics still
count all-correct / all-wrong groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SURPLUS_POLICIES = ("keep", "drop")


@dataclass(frozen=True)
class FilterStats:
    """Counts from filtering some groups (one ``add`` call; add two with ``+`` to accumulate a step)."""

    num_groups: int = 0
    num_kept: int = 0
    num_all_correct: int = 0
    num_all_wrong: int = 0

    def __add__(self, other: FilterStats) -> FilterStats:
        return FilterStats(
            num_groups=self.num_groups + other.num_groups,
            num_kept=self.num_kept + other.num_kept,
            num_all_correct=self.num_all_correct + other.num_all_correct,
            num_all_wrong=self.num_all_wrong + other.num_all_wrong,
        )

    def _fraction(self, count: int) -> float:
        return count / self.num_groups if self.num_groups else 0.0

    @property
    def kept_fraction(self) -> float:
        return self._fraction(self.num_kept)

    @property
    def all_correct_fraction(self) -> float:
        return self._fraction(self.num_all_correct)

    @property
    def all_wrong_fraction(self) -> float:
        return self._fraction(self.num_all_wrong)


def group_accs(group: Any) -> list[bool]:
    """Per-response correctness of a group: its ``accs`` attribute, or its ``"accs"`` key for a mapping."""
    accs = group["accs"] if isinstance(group, Mapping) and "accs" in group else getattr(group, "accs", None)
    if accs is None:
        raise TypeError(
            f"dynamic sampling: a group must expose per-response correctness as .accs or ['accs'], "
            f"got {type(group).__name__}"
        )
    return [bool(acc) for acc in accs]


class DynamicSamplingBuffer:
    """Collects groups with mixed outcomes until ``target_groups`` are held; see the module docstring.

    Usage per training step::

        while not buffer.is_full and rounds < max_rounds:
            stats += buffer.add(generate_and_grade(prompts))
        groups = buffer.pop() if buffer.is_full else buffer.drain()
    """

    def __init__(self, target_groups: int, *, surplus_policy: str = "keep", filter_groups: bool = True) -> None:
        if target_groups <= 0:
            raise ValueError(f"DynamicSamplingBuffer: target_groups must be positive, got {target_groups}")
        if surplus_policy not in SURPLUS_POLICIES:
            raise ValueError(
                f"DynamicSamplingBuffer: unknown surplus_policy {surplus_policy!r}; expected one of {SURPLUS_POLICIES}"
            )
        self.target_groups = target_groups
        self.surplus_policy = surplus_policy
        self.filter_groups = filter_groups
        self._groups: list[Any] = []

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def is_full(self) -> bool:
        return len(self._groups) >= self.target_groups

    @property
    def num_missing(self) -> int:
        """Groups still needed to fill the batch (0 when full)."""
        return max(self.target_groups - len(self._groups), 0)

    def add(self, groups: Iterable[Any]) -> FilterStats:
        """Filter ``groups`` and append the kept ones; returns the counts of this call."""
        num_groups = num_kept = num_all_correct = num_all_wrong = 0
        for index, group in enumerate(groups):
            accs = group_accs(group)
            if not accs:
                raise ValueError(f"DynamicSamplingBuffer.add: group {index} has no responses (empty accs)")
            num_correct = sum(accs)
            all_correct = num_correct == len(accs)
            all_wrong = num_correct == 0
            num_groups += 1
            num_all_correct += all_correct
            num_all_wrong += all_wrong
            if not self.filter_groups or not (all_correct or all_wrong):
                self._groups.append(group)
                num_kept += 1
        return FilterStats(num_groups, num_kept, num_all_correct, num_all_wrong)

    def pop(self) -> list[Any]:
        """The first ``target_groups`` groups; the surplus is kept or dropped per ``surplus_policy``."""
        if not self.is_full:
            raise RuntimeError(
                f"DynamicSamplingBuffer.pop: holds {len(self._groups)} of {self.target_groups} groups; "
                "add more or call drain() when the generation round cap is hit"
            )
        return self.drain()

    def drain(self) -> list[Any]:
        """Up to ``target_groups`` groups, however many are held (for when generation rounds run out).

        The surplus beyond ``target_groups`` is handled as in ``pop``.
        """
        batch = self._groups[: self.target_groups]
        self._groups = self._groups[self.target_groups :] if self.surplus_policy == "keep" else []
        return batch

    def remove_if(self, predicate: Callable[[Any], bool]) -> list[Any]:
        """Remove and return the held groups for which ``predicate`` is true (e.g. groups too stale to train)."""
        removed = [group for group in self._groups if predicate(group)]
        if removed:
            self._groups = [group for group in self._groups if not predicate(group)]
        return removed

    def state_dict(self) -> dict[str, Any]:
        """Plain state: config and the held groups (a new list; the group objects themselves are not copied)."""
        return {
            "target_groups": self.target_groups,
            "surplus_policy": self.surplus_policy,
            "filter_groups": self.filter_groups,
            "groups": list(self._groups),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the held groups. The buffer's own config wins, so a resumed run may change the batch size."""
        if "groups" not in state:
            raise KeyError("DynamicSamplingBuffer.load_state_dict: state has no 'groups'")
        groups = list(state["groups"])
        for group in groups:
            group_accs(group)  # fail at load time, not mid-step, on an object that is not a group
        self._groups = groups
