"""The embedded engine's streamed requests: a background worker that decodes submitted requests and hands each one
back as soon as its samples are done.

* :class:`StreamWorker` — a daemon thread: takes every queued request from the :class:`RequestBook`, decodes them
  together (rows sorted by prompt length and cut into chunks as :meth:`EmbeddedEngine.generate` does), then the
  next queued set. It is given the engine's row decoder and served version, nothing else of the engine.
* :class:`StreamedRows` maps a chunk's rows back to requests; its :class:`ChunkListener` (the decode loop's
  :class:`~.decode_chunk.RowListener`) stops the rows of aborted requests at their next step
  and finishes a request in the book when its last sample is done.

Weight updates while requests are in flight: :mod:`.weight_gate`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Sequence

import torch

from dapo_megatron.rollout.embedded.decode_chunk import GeneratedRow
from dapo_megatron.rollout.engine import GenerationRequest, Sample, SamplingParams
from dapo_megatron.rollout.request_book import RequestBook
from dapo_megatron.rollout.sampling import per_sample_seeds, resolve_call_seed


class StreamedRows:
    """The rows of one worker pass: row ``(i, j)`` is sample ``j`` of ``requests[i]``."""

    def __init__(self, book: RequestBook, requests: Sequence[GenerationRequest], version: int) -> None:
        self.book = book
        self.requests = list(requests)
        self.version = version
        self._samples: list[dict[int, Sample]] = [{} for _ in self.requests]

    def live_rows(self, rows: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``rows`` without those of aborted requests, which finish here with no tokens (before any compute)."""
        live = []
        for request_index, sample_index in rows:
            if self.book.is_aborted(self.requests[request_index].request_id):
                self.add_sample(request_index, sample_index, Sample(prompt_index=0, token_ids=[], logprobs=[],
                                                                    finish_reason="abort", weight_version=self.version))
            else:
                live.append((request_index, sample_index))
        return live

    def for_chunk(self, chunk_rows: list[tuple[int, int]]) -> "ChunkListener":
        return ChunkListener(self, chunk_rows)

    def add_sample(self, request_index: int, sample_index: int, sample: Sample) -> None:
        """Sample ``sample_index`` of request ``request_index`` is done; the request finishes with its last one."""
        done = self._samples[request_index]
        done[sample_index] = sample
        request = self.requests[request_index]
        if len(done) == request.params.n:
            self.book.finish(request.request_id, [done[j] for j in range(request.params.n)])


class ChunkListener:
    """What the decode loop of one chunk calls: which of its rows were aborted, and which rows are done."""

    def __init__(self, rows: StreamedRows, chunk_rows: list[tuple[int, int]]) -> None:
        self.rows = rows
        self.chunk_rows = chunk_rows
        self._request_ids = [rows.requests[i].request_id for i, _ in chunk_rows]

    def aborted(self, batch_rows: torch.Tensor) -> torch.Tensor:
        """bool ``[len(batch_rows)]``: the chunk rows (indices into the chunk) whose request was aborted."""
        if not self.rows.book.has_aborted():  # every decode step asks; almost always nothing was aborted
            return torch.zeros(len(batch_rows), dtype=torch.bool)
        flags = {rid: self.rows.book.is_aborted(rid) for rid in set(self._request_ids[r] for r in batch_rows.tolist())}
        return torch.tensor([flags[self._request_ids[r]] for r in batch_rows.tolist()], dtype=torch.bool)

    def finished(self, chunk_row: int, row: GeneratedRow) -> None:
        request_index, sample_index = self.chunk_rows[chunk_row]
        versions = list(row.token_versions)
        self.rows.add_sample(request_index, sample_index, Sample(
            prompt_index=0, token_ids=row.token_ids, logprobs=row.logprobs, finish_reason=row.finish_reason,
            weight_version=versions[0] if versions else self.rows.version, token_versions=versions,
            routed_experts=row.routed_experts))


RowDecoder = Callable[[Sequence[Sequence[int]], torch.Tensor, SamplingParams, StreamedRows], object]
"""``(prompts, seeds [prompts, n], params, rows)``: decode every sample row of ``prompts``, reporting to ``rows``."""


class StreamWorker:
    """The background thread of an embedded engine's streamed requests: ``decode_rows`` decodes a pass,
    ``served_version()`` is what a request aborted before its first token reports."""

    POLL_S = 0.2  # how often an idle worker looks at the closed flag

    def __init__(self, book: RequestBook, decode_rows: RowDecoder, served_version: Callable[[], int]) -> None:
        self.book = book
        self.decode_rows = decode_rows
        self.served_version = served_version
        self.thread = threading.Thread(target=self._run, name="embedded-stream", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.book.closed:
                requests = self.book.take_all_queued(timeout_s=self.POLL_S)
                by_params: dict[SamplingParams, list[GenerationRequest]] = {}
                for request in requests:  # one pass decodes requests that differ at most in their seed together
                    by_params.setdefault(dataclasses.replace(request.params, seed=None), []).append(request)
                for params, group in by_params.items():
                    seeds = torch.cat([per_sample_seeds(resolve_call_seed(r.params.seed), 1, params.n) for r in group])
                    self.decode_rows([r.prompt for r in group], seeds, params,
                                     StreamedRows(self.book, group, self.served_version()))
        except BaseException as error:  # noqa: BLE001 - the next poll() raises it in the caller's thread
            self.book.fail(error)

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)

