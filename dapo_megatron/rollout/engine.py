"""The rollout-engine interface the trainer talks to.

Two engines implement it:

* :class:`dapo_megatron.rollout.embedded.engine.EmbeddedEngine` — in-process sampling on an HF-format copy of the
  policy (the CPU default, no server);
* :class:`dapo_megatron.rollout.sglang.engine.SGLangEngine` — SGLang servers launched here or attached by URL
  (the production path).

Both receive new weights the same way: the buckets of ``(hf_name, tensor)`` pairs the Megatron-side exporter
(:mod:`dapo_megatron.handoff.exporter`) makes, consumed as they come (never re-bucketed), tagged with a monotonically
increasing version number. With LoRA (``model.lora.handoff: adapter``) the base comes that way once and then
:meth:`~RolloutEngine.update_adapter` brings each new adapter alone, under the same version numbers.

Two ways to generate, both offered by both engines:

* :meth:`RolloutEngine.generate` — blocking: a list of prompts in, all their samples out (sync mode, validation).
* streaming — :meth:`~RolloutEngine.submit` requests (one prompt, ``n`` samples, an id each), which run in the
  background; :meth:`~RolloutEngine.poll` returns requests as soon as all their samples are done;
  :meth:`~RolloutEngine.abort` stops requests at their next token (they come back from ``poll`` with
  ``finish_reason == "abort"`` and the tokens generated so far, which the caller counts as wasted). The async
  rollout driver (:mod:`dapo_megatron.collectors.asynchronous`) is built on it.

Weight updates and versions. :meth:`~RolloutEngine.update_weights` may be called while streamed requests are in
flight (from another thread than the one polling). They are paused between two tokens, the engine swaps the
weights, the KV cache of each request's prompt and tokens so far is recomputed with the new weights, and decoding
continues — a partial rollout. Every token records the version of the weights that sampled it
(``Sample.token_versions``, non-decreasing along a response); ``Sample.weight_version`` is the first (oldest) one.
Which tokens the trainer may train, and how, is decided from those versions
(:mod:`dapo_megatron.algorithm.staleness`, :mod:`dapo_megatron.algorithm.rollout_correction`).

GPUs shared with the trainer (``rollout.placement: colocated``, :mod:`dapo_megatron.rollout.placement`): the trainer
calls :meth:`~RolloutEngine.before_generation` / :meth:`~RolloutEngine.after_generation` around every generation and
:meth:`~RolloutEngine.before_policy_update` before training; the next :meth:`~RolloutEngine.update_weights` brings the
released weights back. They do nothing for an engine with memory of its own (the default).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Literal, Sequence

from dapo_megatron.hf_format.buckets import Bucket

if TYPE_CHECKING:
    import torch

    from dapo_megatron.hf_format.peft_adapter import PeftAdapter

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
    # A row also stops once its last generated tokens are one of these (kept, reason "stop"): a tool call's end,
    # which is several tokens in most tokenizers. The embedded engine matches these ids; SGLang matches text, so a
    # caller that sets them sets their text in stop_strings too (one tokenization of a text is not the only one).
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    stop_strings: tuple[str, ...] = ()

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
        if any(not sequence for sequence in self.stop_sequences) or any(not text for text in self.stop_strings):
            raise ValueError(f"SamplingParams: empty stop sequence in {self.stop_sequences} / {self.stop_strings}")


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
    weight_version: int = 0  # the version that sampled the first (oldest) token
    token_versions: list[int] = field(default_factory=list)  # per token; empty: all weight_version
    # Multi-turn rollouts (dapo_megatron/rollout/multi_turn.py): 1 where the engine sampled the token, 0 where a tool's
    # output was appended; None: every token sampled. A tool token's logprob is 0.0 and its version the one that
    # sampled the turn before it; only tokens with mask 1 are read as sampled (loss, correction, statistics).
    loss_mask: list[int] | None = None
    tool_use: "ToolUse | None" = None
    # Mixture-of-experts engines asked for their routing (algorithm.moe_routing_replay: replay_rollout): int16
    # [P + R - 1, layers, top-k] on the host, the experts of every prompt token and every response token but the last
    # (dapo_megatron/policy/rollout_routing.py); None otherwise.
    routed_experts: "torch.Tensor | None" = None


@dataclass
class ToolUse:
    """What one multi-turn response did with its tools."""

    turns: int = 0  # generate calls
    calls: int = 0  # tool calls run
    failed: int = 0  # of them, not ok (ToolResult.kind set)
    timeouts: int = 0  # of the failed, kind "timeout"
    output_tokens: int = 0  # tool-output tokens appended (mask 0)


@dataclass(frozen=True)
class GenerationRequest:
    """One streamed request: ``params.n`` samples of ``prompt``. ``request_id`` must be unique among the requests
    in flight; ``params.seed`` seeds this request alone (its samples get per-sample seeds derived from it)."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"GenerationRequest {self.request_id!r}: the prompt is empty")


@dataclass
class FinishedRequest:
    """A streamed request whose ``n`` samples are all done (``prompt_index`` is 0 in each)."""

    request_id: str
    samples: list[Sample]

    @property
    def aborted(self) -> bool:
        return any(sample.finish_reason == "abort" for sample in self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(len(sample.token_ids) for sample in self.samples)


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
    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Start ``requests`` in the background and return at once."""

    @abc.abstractmethod
    def poll(self, timeout_s: float = 0.0) -> list[FinishedRequest]:
        """The streamed requests finished (or aborted) since the last call, waiting up to ``timeout_s`` for one.

        Raises :class:`RolloutError` if the engine failed in the background (a server lost past its restarts)."""

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop these streamed requests at their next token; ids already finished or unknown are ignored."""

    @property
    @abc.abstractmethod
    def num_in_flight(self) -> int:
        """Streamed requests submitted and not yet returned by :meth:`poll`."""

    @abc.abstractmethod
    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Replace the served weights with the full, HF-named tensors of ``buckets`` and tag them ``version``.

        A bucket is consumed entirely before the next is pulled (the producer may reuse its memory). Must fail
        loudly if afterwards the engine does not serve ``version``. Streamed requests in flight continue on the new
        weights (see the module docstring).
        """

    def update_adapter(self, adapter: "PeftAdapter", version: int) -> None:
        """Serve the base weights of the last :meth:`update_weights` with the LoRA ``adapter`` (full tensors by PEFT's
        names) as ``version`` (``model.lora.handoff: adapter``). An engine that cannot raises; the trainer then needs
        ``handoff: merged``."""
        raise NotImplementedError(f"{type(self).__name__} does not take LoRA adapters; use model.lora.handoff: merged")

    def stage_stream_receiver(self):
        """How each pipeline stage's source can stream its weights into this engine directly, one stream per stage:
        a picklable :class:`dapo_megatron.handoff.StageStreamReceiver`, followed by :meth:`commit_stage_streams`.
        None (the default): the stages are gathered on global rank 0 and arrive through :meth:`update_weights`."""
        return None

    def commit_stage_streams(self, version: int) -> None:
        """After every stage has streamed through :meth:`stage_stream_receiver`: check and serve ``version``."""
        raise NotImplementedError(f"{type(self).__name__} does not receive per-stage weight streams")

    # ---- turns on GPUs shared with the trainer (colocated placement); nothing to do by default -------------------
    def before_generation(self) -> None:
        """Take back the memory generating needs (a colocated server's KV cache); raises while the weights are
        released and no :meth:`update_weights` brought new ones."""

    def after_generation(self) -> None:
        """Give the memory only generating needs back to the trainer (a colocated server's KV cache)."""

    def before_policy_update(self) -> None:
        """Give the rest back too (a colocated server's weights): the trainer needs the GPU; the next
        :meth:`update_weights` takes the weights' memory back and fills it."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version of the weights currently served."""

    @abc.abstractmethod
    def health(self) -> EngineHealth: ...

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Abort streamed requests in flight and release every resource (servers, processes, memory). Safe to call
        twice."""

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


class RolloutError(RuntimeError):
    """A rollout engine failed in a way the trainer cannot hide (server died past its retries, bad reply)."""
