"""Deterministic, resumable prompt batches across epochs.

Epoch ``e`` visits the items in the order ``random.Random(seed + e).shuffle(range(n))``. Batches are consecutive
slices of that order; a request that does not fit in what is left of the epoch starts the next epoch (the leftover
items of the old epoch are dropped, like a ``drop_last`` data loader), so no batch holds an item twice. The position
is ``(epoch, cursor)``; ``state_dict()``/``load_state_dict()`` save and restore it, so a resumed run that asks for the
same batch sizes sees exactly the same batches. Python's ``random.Random`` is used because its shuffle sequence
for a given integer seed is stable across platforms and versions.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Generic, Iterator, Sequence, TypeVar

logger = logging.getLogger(__name__)

Item = TypeVar("Item")


class PromptSampler(Generic[Item]):
    """Yields batches of ``items`` (e.g. ``PromptRecord``) in a seeded order that is reshuffled every epoch."""

    def __init__(self, items: Sequence[Item], *, batch_size: int, seed: int):
        if len(items) == 0:
            raise ValueError("PromptSampler needs at least one item")
        if not 0 < batch_size <= len(items):
            raise ValueError(f"batch_size must be in [1, {len(items)}] (the number of items), got {batch_size}")
        self.items = items
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.cursor = 0
        self._order = self._epoch_order(epoch)

    def next_indices(self, size: int | None = None) -> list[int]:
        """Positions in ``items`` of the next batch of ``size`` (default ``batch_size``) items."""
        size = self.batch_size if size is None else size
        if not 0 < size <= len(self.items):
            raise ValueError(f"batch size must be in [1, {len(self.items)}], got {size}")
        if self.cursor + size > len(self.items):
            dropped = len(self.items) - self.cursor
            logger.info("prompt epoch %d done (%d leftover items dropped)", self.epoch, dropped)
            self._start_epoch(self.epoch + 1)
        batch = self._order[self.cursor : self.cursor + size]
        self.cursor += size
        return batch

    def next_batch(self, size: int | None = None) -> list[Item]:
        """The next batch of items; see :meth:`next_indices`."""
        return [self.items[i] for i in self.next_indices(size)]

    def __iter__(self) -> Iterator[list[Item]]:
        """Endless batches of ``batch_size``; the caller decides when to stop."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "num_items": len(self.items), "epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved position. The seed and item count must match: another dataset would replay other batches."""
        for key in ("seed", "num_items"):
            current = self.seed if key == "seed" else len(self.items)
            if state[key] != current:
                raise ValueError(f"sampler state has {key}={state[key]} but this sampler has {key}={current}")
        if not 0 <= state["cursor"] <= len(self.items) or state["epoch"] < 0:
            position = f"epoch={state['epoch']} cursor={state['cursor']}"
            raise ValueError(f"sampler state has an impossible position: {position}")
        self._start_epoch(int(state["epoch"]))
        self.cursor = int(state["cursor"])
