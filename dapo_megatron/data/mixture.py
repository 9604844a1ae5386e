"""Several training sources mixed by weight (``data.train: [{path, weight, name}, ...]``), drawn deterministically
and resumably.

Which source the n-th prompt comes from is decided by largest deficit: the source i whose share
``weight_i / Σ weight`` of n prompts is furthest ahead of what it has given so far (``share_i · n − given_i``
largest; ties to the earlier source). So every prefix of the draws holds each source within one prompt of its share
— a batch of 512 with weights 0.7 / 0.3 holds 358 / 154 (or 359 / 153) — with no randomness to converge.
Within a source, prompts come in the seeded per-epoch shuffle of :class:`~dapo_megatron.data.sampler.PromptSampler`
(one epoch of a source ends independently of the others' epochs). A source read as drawn
(:class:`~dapo_megatron.data.folders.StreamedPrompts`) may skip a row; the next one of that source is drawn instead.

The position — each source's epoch, cursor, prompts given and rows skipped — is the checkpoint's
(:meth:`MixtureSampler.state_dict`), so a resumed run draws exactly the prompts the uninterrupted run would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.user_errors import DataError


@dataclass
class MixtureSource:
    """One source: its name (per-source metrics), weight and prompts (a sequence; None at a skipped row)."""

    name: str
    weight: float
    prompts: Sequence[PromptRecord | None]


def source_seed(seed: int, index: int) -> int:
    """Source ``index``'s shuffle seed: far from the others' (a source's epoch e is seeded seed + e)."""
    return (seed + 1) * 1_000_003 + index * 7_919_000


class MixtureSampler:
    """Draws prompts from ``sources`` in proportion to their weights (see the module docstring)."""

    def __init__(self, sources: list[MixtureSource], *, seed: int):
        if not sources:
            raise ValueError("MixtureSampler needs at least one source")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must differ, got {names}")
        total = sum(s.weight for s in sources)
        self.sources = sources
        self.shares = [s.weight / total for s in sources]
        self.seed = seed
        self._orders = [PromptSampler(range(len(s.prompts)), batch_size=1, seed=source_seed(seed, i))
                        for i, s in enumerate(sources)]
        self.given = [0] * len(sources)
        self.skipped = [0] * len(sources)

    def next_source(self) -> int:
        """The index of the source the next prompt comes from (largest deficit)."""
        drawn = sum(self.given) + 1
        deficits = [share * drawn - given for share, given in zip(self.shares, self.given)]
        return max(range(len(deficits)), key=lambda i: (deficits[i], -i))

    def next_batch(self, size: int) -> list[PromptRecord]:
        return [self._next_prompt() for _ in range(size)]

    def _next_prompt(self) -> PromptRecord:
        index = self.next_source()
        source, order = self.sources[index], self._orders[index]
        for _ in range(len(source.prompts)):
            (row,) = order.next_indices(1)
            record = source.prompts[row]
            if record is not None:
                self.given[index] += 1
                return record
            self.skipped[index] += 1
        raise DataError(f"data.train source {source.name!r}: {len(source.prompts)} rows drawn in a row were all "
                        "skipped (malformed or longer than data.max_prompt_length)")

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mixture", "seed": self.seed,
                "sources": [{"name": s.name, "given": given, "skipped": skipped, "order": order.state_dict()}
                            for s, given, skipped, order in zip(self.sources, self.given, self.skipped, self._orders)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved position; the sources (names, row counts) and the seed must be the run's."""
        if state.get("kind") != "mixture":
            raise ValueError("the checkpoint's sampler is a single pool of prompts (data.train_files or the synthetic "
                             "task), this run's a data.train mixture: resume with the data config it was written with")
        saved = [s["name"] for s in state["sources"]]
        if saved != [s.name for s in self.sources] or state["seed"] != self.seed:
            raise ValueError(f"the checkpoint's data.train sources are {saved} (seed {state['seed']}), this run's "
                             f"{[s.name for s in self.sources]} (seed {self.seed})")
        for i, source_state in enumerate(state["sources"]):
            self._orders[i].load_state_dict(source_state["order"])
            self.given[i] = int(source_state["given"])
            self.skipped[i] = int(source_state["skipped"])
