"""The rollout-engine interface the trainer talks to.

Two engines implement it:

* :class:`dapo_megatron.rollout.embedded.EmbeddedEngine` — in-process sampling on an HF-format copy of the
  policy (the CPU default, no server);
* :class:`dapo_megatron.rollout.sglang_engine.SGLangEngine` — SGLang servers launched here or attached by URL
  (the production path).

Both receive new weights the same way: the buckets of ``(hf_name, tensor)`` pairs the Megatron-side exporter
(:mod:`dapo_megatron.handoff.exporter`) makes, consumed as they come (never re-bucketed), tagged with a monotonically
increasing version number.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable, Literal, Sequence

from dapo_megatron.hf_format.buckets import Bucket

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one generate call (the same for every prompt in it).

    ``seed`` makes a call reproducible: the same prompts, weights and seed give the same samples, which is what
    lets a resumed run replay the exact rollouts of the run it continues.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k truncation
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Sample:
    """One generated response.

    ``logprobs[i]`` is the engine's log-probability of ``token_ids[i]`` under the distribution it sampled from
    (logits divided by the temperature, before top-p/top-k truncation), so it is directly comparable to the
    policy's recomputed log-probs at the same temperature.
    """

    prompt_index: int  # index into the prompts of the generate call
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int = 0


@dataclass
class EngineHealth:
    healthy: bool
    weight_version: int
    detail: str = ""
    servers: list[str] = field(default_factory=list)


class RolloutEngine(abc.ABC):
    """Generates responses for token-id prompts and accepts new policy weights."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Sample]]:
        """Return, for each prompt in order, its ``params.n`` samples."""

    @abc.abstractmethod
    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Replace the served weights with the full, HF-named tensors of ``buckets`` and tag them ``version``.

        A bucket is consumed entirely before the next is pulled (the producer may reuse its memory). Must fail
        loudly if afterwards the engine does not serve ``version``.
        """

    def stage_stream_receiver(self):
        """How each pipeline stage's source can stream its weights into this engine directly, one stream per stage:
        a picklable :class:`dapo_megatron.handoff.StageStreamReceiver`, followed by :meth:`commit_stage_streams`.
        None (the default): the stages are gathered on global rank 0 and arrive through :meth:`update_weights`."""
        return None

    def commit_stage_streams(self, version: int) -> None:
        """After every stage has streamed through :meth:`stage_stream_receiver`: check and serve ``version``."""
        raise NotImplementedError(f"{type(self).__name__} does not receive per-stage weight streams")

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version of the weights currently served."""

    @abc.abstractmethod
    def health(self) -> EngineHealth: ...

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release every resource (servers, processes, memory). Safe to call twice."""

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


class RolloutError(RuntimeError):
    """A rollout engine failed in a way the trainer cannot hide (server died past its retries, bad reply)."""
