"""What each colocated SGLang server has released, and the release/resume calls that change it (the engine's turns:
:meth:`~dapo_megatron.rollout.sglang.engine.SGLangEngine.before_generation` and the others;
:mod:`dapo_megatron.rollout.placement` has the states and the SGLang facts)."""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from dapo_megatron.rollout.engine import RolloutError
from dapo_megatron.rollout.placement import ServerMemory, ServerMemoryError
from dapo_megatron.rollout.sglang.pool import ServerSlot

logger = logging.getLogger(__name__)

# How long a colocated server may take to finish its last batch before it releases memory (its scheduler's overlap
# loop clears one batch after the last reply): seconds, not minutes, on a server that is done generating.
IDLE_WAIT_S = 60.0


class ColocatedMemory:
    """The bookkeeping of the servers' memory moves; with ``colocated`` False every move is a no-op."""

    def __init__(self, colocated: bool) -> None:
        self.colocated = colocated
        self._released: dict[int, tuple[int, ServerMemory]] = {}  # slot index -> (its generation, what it released)

    def of(self, slot: ServerSlot) -> ServerMemory:
        """What ``slot``'s server has released (a server restarted since holds everything again)."""
        generation, memory = self._released.get(slot.index, (slot.generation, ServerMemory()))
        return memory if generation == slot.generation else ServerMemory()

    def move(self, slots: Sequence[ServerSlot], tags_of: Callable[[ServerMemory], tuple[str, ...]], *,
             release: bool) -> None:
        """Release (or resume) on each server the tags ``tags_of(its ServerMemory)`` names, and record it. A release
        waits for the server to be idle first (SGLang asserts it, and the failed assertion ends the server) and is
        not sent when it does not become idle."""
        if not self.colocated:
            return
        for slot in slots:
            memory = self.of(slot)
            tags = tags_of(memory)
            if not tags:
                continue
            if release:
                try:
                    slot.client.wait_until_idle(IDLE_WAIT_S)
                except RolloutError as error:
                    raise RolloutError(f"SGLang server {slot.index} did not become idle within {IDLE_WAIT_S:g} s, "
                                       f"so its memory was not released (releasing it busy would end the server): "
                                       f"{error}") from error
                slot.client.release_memory_occupation(tags)
                memory = memory.released(tags)
            else:
                slot.client.resume_memory_occupation(tags)
                memory = memory.resumed(tags)
            self._released[slot.index] = (slot.generation, memory)
            logger.info("SGLang server %d %s %s", slot.index, "released" if release else "resumed", ", ".join(tags))

    def require_can_generate(self, slots: Sequence[ServerSlot]) -> None:
        held_back = [slot.client.base_url for slot in slots if not self.of(slot).can_generate]
        if held_back:
            raise ServerMemoryError(f"SGLangEngine: colocated server(s) {', '.join(held_back)} gave their memory to "
                                    f"the trainer; call before_generation() before generating")
