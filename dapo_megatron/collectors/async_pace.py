"""How far ahead the async rollout driver generates, and in what chunks.

The driver keeps ``buffered groups + live requests × observed keep rate`` at ``target_groups``
(``train_batch_size × rollout.max_staleness``), with at most ``max_in_flight`` prompts in flight
(``algorithm.max_gen_rounds`` chunks), so what it generates during step s is trained in steps s+1 … s+max_staleness.
A chunk is sized to the expected shortfall: a full chunk submitted for a shortfall of a few groups would overshoot by
most of a batch, whose groups then age past the bound and are dropped.
"""

from __future__ import annotations

import math

from dapo_megatron.config import DAPOConfig

MIN_KEEP_RATE = 0.05  # the estimate's floor: a run of filtered groups must not ask for an unbounded chunk


class GenerationPace:
    """``chunk_size``: prompts per chunk (``algorithm.gen_batch_size``, or the batch size without dynamic sampling).
    ``expected_keep_rate``: the share of finished groups assumed kept until one has finished."""

    def __init__(self, *, chunk_size: int, target_groups: int, max_in_flight: int, expected_keep_rate: float) -> None:
        self.chunk_size = chunk_size
        self.target_groups = target_groups
        self.max_in_flight = max_in_flight
        self.expected_keep_rate = expected_keep_rate
        self._kept = 0
        self._finished = 0

    @classmethod
    def from_config(cls, config: DAPOConfig) -> "GenerationPace":
        a, r, t = config.algorithm, config.rollout, config.trainer
        chunk_size = a.gen_batch_size if a.dynamic_sampling else t.train_batch_size
        return cls(chunk_size=chunk_size, target_groups=t.train_batch_size * r.max_staleness,
                   max_in_flight=a.max_gen_rounds * chunk_size, expected_keep_rate=t.train_batch_size / chunk_size)

    def observe(self, num_kept: int) -> None:
        """A group finished; dynamic sampling kept ``num_kept`` (0 or 1) of it."""
        self._kept += num_kept
        self._finished += 1

    @property
    def keep_rate(self) -> float:
        rate = self._kept / self._finished if self._finished else self.expected_keep_rate
        return min(max(rate, MIN_KEEP_RATE), 1.0)

    def next_chunk_size(self, *, buffered: int, live: int, in_flight: int) -> int:
        """Prompts to submit now (0: none) with ``buffered`` groups usable by the next batch, ``live`` requests that
        may still become groups and ``in_flight`` requests in all (aborted ones included, until they are back)."""
        keep_rate = self.keep_rate
        shortfall = self.target_groups - buffered - live * keep_rate
        size = min(self.chunk_size, math.ceil(shortfall / keep_rate))
        if shortfall <= 0 or in_flight + size > self.max_in_flight:
            return 0
        return size
