"""One chunk of the embedded engine's rows being decoded, one named step per job.

The engine (:meth:`.engine.EmbeddedEngine._decode_chunk`) runs the steps in this order, each
decode step inside its weight gate:

1. :meth:`DecodingChunk.prefill` — the prompts (layout, masks and cache: :mod:`.decode_batch`);
2. then per step ``t``: :meth:`~DecodingChunk.stop_aborted_rows` (streaming: rows whose request was aborted end
   with the tokens they have), :meth:`~DecodingChunk.re_prefill` when the weights changed since the last step,
   :meth:`~DecodingChunk.sample`, :meth:`~DecodingChunk.stop_at_stop_tokens` (stop tokens and stop sequences),
   :meth:`~DecodingChunk.drop_finished_rows` and :meth:`~DecodingChunk.decode` (the logits of step ``t + 1``);
3. :meth:`DecodingChunk.results`.

Two views of the rows. The chunk side (``out_*``, ``lengths``, ``stopped``, ``aborted``) keeps one entry per row of
the chunk for the whole decode. The batch side (``rows``, ``key_valid``, ``prompt_lengths``, ``finished``,
``tokens``, ``logits`` and the cache) holds the rows still in the batch: finished rows leave it once they are a
large enough share, and ``rows`` maps batch rows to chunk rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
from transformers.cache_utils import Cache

from dapo_megatron.rollout.embedded.decode_batch import LeftPaddedBatch, preallocated_kv_cache, prefill
from dapo_megatron.rollout.embedded.routing_capture import RoutingCapture
from dapo_megatron.rollout.engine import FinishReason, SamplingParams
from dapo_megatron.rollout.sampling import TokenSampler, per_sample_uniforms

DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Cache], torch.Tensor]
"""``(tokens [B], key mask [B, 1, 1, S], positions [B, 1], cache) -> next logits [B, V]``
(:class:`.lean_decode.LeanDecoder`)."""


@dataclass(frozen=True)
class GeneratedRow:
    """One decoded row: its tokens, their log-probs and the weight version that sampled each."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    token_versions: list[int]
    routed_experts: torch.Tensor | None = None  # int16 [P + R - 1, layers, k] when the routing was captured


class RowListener(Protocol):
    """Streaming: which rows of the chunk were aborted, and where a row goes as soon as it is done."""

    def aborted(self, batch_rows: torch.Tensor) -> torch.Tensor:
        """bool ``[len(batch_rows)]`` for chunk rows ``batch_rows``: their request was aborted."""

    def finished(self, chunk_row: int, row: GeneratedRow) -> None: ...


class DecodingChunk:
    """The state of one chunk's decode loop and its steps (see the module docstring for the order and the two views
    of the rows). ``seeds[i]`` seeds row ``i``'s sampling; ``listener`` is None when the call blocks."""

    def __init__(self, prompts: Sequence[Sequence[int]], seeds: torch.Tensor, params: SamplingParams,
                 sampler: TokenSampler, *, num_layers: int, listener: RowListener | None = None,
                 capture: RoutingCapture | None = None) -> None:
        self.steps = params.max_new_tokens
        self.batch = LeftPaddedBatch.build(prompts, self.steps, pad_token_id=0)
        self.sampler = sampler
        self.listener = listener
        self.num_layers = num_layers
        self.uniforms = None if sampler.is_greedy else per_sample_uniforms(seeds, self.steps)
        self.stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.int64) if params.stop_token_ids else None
        self.stop_sequences = [torch.tensor(sequence, dtype=torch.int64) for sequence in params.stop_sequences]
        num_rows = len(prompts)
        # chunk side
        self.out_tokens = torch.zeros(num_rows, self.steps, dtype=torch.int64)
        self.out_logprobs = torch.zeros(num_rows, self.steps, dtype=torch.float32)
        self.lengths = torch.full((num_rows,), self.steps, dtype=torch.int64)
        self.stopped = torch.zeros(num_rows, dtype=torch.bool)
        self.aborted = torch.zeros(num_rows, dtype=torch.bool)
        self.step_versions: list[int] = []  # the weight version that sampled step t's tokens
        self.emitted: set[int] = set()  # rows already handed to the listener
        # routing (capture given): the prompt slots' and each step's token's expert ids, per chunk row
        self.capture = capture
        if capture is not None:
            shape = (num_rows, self.batch.padded_length + self.steps, capture.num_layers, capture.topk)
            self.out_routing = torch.zeros(shape, dtype=torch.int16)
        # batch side
        self.rows = torch.arange(num_rows)
        self.key_valid = self.batch.key_valid
        self.prompt_lengths = self.batch.prompt_lengths
        self.finished = torch.zeros(num_rows, dtype=torch.bool)
        self.tokens: torch.Tensor | None = None  # [rows in the batch]: the last step's
        self.cache: Cache | None = None
        self.logits: torch.Tensor | None = None  # [rows in the batch, V]: the next step's

    @property
    def all_finished(self) -> bool:
        return bool(self.finished.all())

    def prefill(self, model: torch.nn.Module) -> None:
        """The prompts through ``model``: the cache and the first step's logits."""
        self.cache, self.logits = prefill(model, self.batch.input_ids, self.key_valid, self._empty_cache(),
                                          self.capture)
        self._keep_routing(0)

    def re_prefill(self, model: torch.nn.Module, step: int) -> None:
        """The weights changed before ``step``: the cache holds the old weights' keys and values. Recompute it and
        the logits from the prompts and the tokens so far, with ``model``'s new weights."""
        prefix = torch.cat([self.batch.input_ids[self.rows], self.out_tokens[self.rows, :step]], 1)
        self.cache, self.logits = prefill(model, prefix, self.key_valid, self._empty_cache(), self.capture)
        self._keep_routing(0)  # the continuation attends to the new weights' keys: their routing replaces the old

    def stop_aborted_rows(self, step: int) -> None:
        """Streaming: rows whose request was aborted finish with the ``step`` tokens they have."""
        if self.listener is None:
            return
        newly_aborted = self.listener.aborted(self.rows) & ~self.finished
        if bool(newly_aborted.any()):
            chunk_rows = self.rows[newly_aborted]
            self.lengths[chunk_rows] = step
            self.aborted[chunk_rows] = True
            self.finished |= newly_aborted
            self._emit(chunk_rows)

    def sample(self, step: int, version: int) -> None:
        """Step ``step``'s tokens and log-probs from the logits, sampled by weights ``version``."""
        self.step_versions.append(version)
        step_uniforms = self.uniforms[self.rows, step] if self.uniforms is not None else None
        self.tokens, logprobs = self.sampler(self.logits, step_uniforms)
        self.out_tokens[self.rows, step] = self.tokens
        self.out_logprobs[self.rows, step] = logprobs

    def stop_at_stop_tokens(self, step: int) -> None:
        """Rows that sampled a stop token, or whose generated tokens now end with a stop sequence, finish with it
        (``step + 1`` tokens)."""
        if self.stop_ids is None and not self.stop_sequences:
            return
        hit = torch.isin(self.tokens, self.stop_ids) if self.stop_ids is not None else torch.zeros_like(self.finished)
        for sequence in self.stop_sequences:
            if len(sequence) <= step + 1:
                hit |= (self.out_tokens[self.rows, step + 1 - len(sequence):step + 1] == sequence).all(1)
        newly_stopped = hit & ~self.finished
        if bool(newly_stopped.any()):
            chunk_rows = self.rows[newly_stopped]
            self.lengths[chunk_rows] = step + 1
            self.stopped[chunk_rows] = True
            self.finished |= newly_stopped
            self._emit(chunk_rows)

    def drop_finished_rows(self, fraction: float) -> None:
        """Finished rows leave the batch once they are at least ``fraction`` of it: later forwards are smaller, at
        the cost of one copy of the cache."""
        num_finished = int(self.finished.sum())
        if not num_finished or num_finished < fraction * len(self.rows):
            return
        keep = (~self.finished).nonzero().squeeze(-1)
        for layer in self.cache.layers:
            layer.batch_select_indices(keep)
        self.rows, self.key_valid, self.tokens = self.rows[keep], self.key_valid[keep], self.tokens[keep]
        self.prompt_lengths, self.finished = self.prompt_lengths[keep], self.finished[keep]

    def decode(self, decode_step: DecodeStep, step: int) -> None:
        """Step ``step``'s tokens through the model: the logits of step ``step + 1``."""
        attended = self.key_valid[:, None, None, : self.batch.padded_length + step + 1]
        self.logits = decode_step(self.tokens, attended, (self.prompt_lengths + step)[:, None], self.cache)
        if self.capture is not None:
            self.capture.routing = self.capture.take(len(self.rows), 1)
            self._keep_routing(self.batch.padded_length + step)

    def _keep_routing(self, start: int) -> None:
        """The rows' routing of the forward just run, from slot ``start`` on."""
        if self.capture is not None:
            routing = self.capture.routing
            self.out_routing[self.rows, start:start + routing.shape[1]] = routing

    def results(self) -> list[GeneratedRow]:
        """Every row of the chunk, in order; the listener receives those it has not received yet."""
        results = [self._row(row) for row in range(len(self.lengths))]
        if self.listener is not None:
            for row, result in enumerate(results):
                if row not in self.emitted:
                    self.listener.finished(row, result)
        return results

    def _emit(self, chunk_rows: torch.Tensor) -> None:
        """Streaming: hand rows that just finished over now."""
        if self.listener is None:
            return
        for row in chunk_rows.tolist():
            self.emitted.add(row)
            self.listener.finished(row, self._row(row))

    def _row(self, row: int) -> GeneratedRow:
        length = int(self.lengths[row])
        return GeneratedRow(
            token_ids=self.out_tokens[row, :length].tolist(),
            logprobs=self.out_logprobs[row, :length].tolist(),
            finish_reason="abort" if bool(self.aborted[row]) else "stop" if bool(self.stopped[row]) else "length",
            token_versions=self.step_versions[:length],
            routed_experts=self._routing(row, length),
        )

    def _routing(self, row: int, length: int) -> torch.Tensor | None:
        """Row ``row``'s ``[P + length − 1, L, k]``: its prompt's slots and its tokens but the last."""
        if self.capture is None:
            return None
        padded = self.batch.padded_length
        start = padded - int(self.batch.prompt_lengths[row])
        return self.out_routing[row, start:padded + max(length - 1, 0)].clone()

    def _empty_cache(self) -> Cache:
        return preallocated_kv_cache(self.num_layers, self.batch.padded_length + self.steps - 1)
