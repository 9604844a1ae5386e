"""The one report of tensors that do not fit a model: missing, unexpected, of the wrong shape (and what else a
caller checks), every problem named in one message.

Callers collect the lists — from safetensors headers, from a stream of tensors, from a distributed checkpoint's
metadata — and :meth:`TensorMismatch.report` words them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence


@dataclass(frozen=True)
class WrongShape:
    name: str
    found: Sequence[int]
    expected: Sequence[int] | str  # a string for a rule rather than one shape, e.g. "[>=101, 48]"
    where: str | None = None  # the file (or checkpoint) holding it

    def __str__(self) -> str:
        place = f" in {self.where}" if self.where else ""
        expected = self.expected if isinstance(self.expected, str) else list(self.expected)
        return f"{self.name}{place}: shape {list(self.found)}, expected {expected}"


@dataclass
class TensorMismatch:
    """What does not fit; empty (falsy) when everything does."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: list[WrongShape] = field(default_factory=list)
    other: dict[str, list[str]] = field(default_factory=dict)  # further problems by label, e.g. "bad values"

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.wrong_shape or any(self.other.values()))

    def report(self, subject: str, *, max_names: int | None = None) -> str:
        """``subject`` then one line per kind of problem, naming every tensor (the first ``max_names`` of each
        kind when given)."""
        lines = [f"{subject}:"]
        kinds = [("missing tensors", self.missing), ("unexpected tensors", self.unexpected),
                 ("shape mismatches", [str(w) for w in self.wrong_shape]), *self.other.items()]
        for label, items in kinds:
            if not items:
                continue
            shown = items if max_names is None else items[:max_names]
            more = f"; ... and {len(items) - len(shown)} more" if len(shown) < len(items) else ""
            lines.append(f"  {label}: {'; '.join(shown)}{more}")
        return "\n".join(lines)


def compare_shapes(found: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], *,
                   where: Callable[[str], str] | None = None,
                   ignore_unexpected: Callable[[str], bool] | None = None) -> TensorMismatch:
    """Names of ``expected`` absent from ``found``, names of ``found`` not expected (unless ``ignore_unexpected``
    says so; pass ``lambda name: True`` when ``found`` may hold more), and shapes that differ (``where(name)``: the
    file holding it)."""
    ignore = ignore_unexpected or (lambda name: False)
    return TensorMismatch(
        missing=sorted(set(expected) - set(found)),
        unexpected=sorted(n for n in set(found) - set(expected) if not ignore(n)),
        wrong_shape=[WrongShape(n, tuple(found[n]), tuple(shape), where(n) if where else None)
                     for n, shape in expected.items() if n in found and tuple(found[n]) != tuple(shape)],
    )
