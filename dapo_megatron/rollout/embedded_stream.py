"""What the embedded engine needs to stream: a gate that lets weight updates in between two decode steps, and a
background worker that decodes submitted requests and hands each one back as soon as its samples are done.

* :class:`WeightGate` — every decode step (forward + sampling) runs inside ``gate.step()``; ``update_weights`` runs
  inside ``gate.exclusive()``, which waits for the steps in progress to end and holds new ones back until the weights
  are swapped. A decode loop that finds the version changed when it enters its next step re-prefills its prompt and
  tokens so far with the new weights (:meth:`EmbeddedEngine._generate_chunk`), so every later token is sampled by
  the new weights alone, and records the version of each step.
* :class:`StreamWorker` — a daemon thread: takes every queued request from the :class:`RequestBook`, decodes them
  together (rows sorted by prompt length and cut into chunks as :meth:`EmbeddedEngine.generate` does), then the
  next queued set. :class:`StreamedRows` maps a chunk's rows back to requests: it stops the rows of aborted requests
  at their next step and finishes a request in the book when its last sample is done.
"""

from __future__ import annotations

import dataclasses
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import torch

from dapo_megatron.rollout.engine import FinishReason, GenerationRequest, Sample, SamplingParams
from dapo_megatron.rollout.request_book import RequestBook
from dapo_megatron.rollout.sampling import per_sample_seeds, resolve_call_seed

if TYPE_CHECKING:
    from dapo_megatron.rollout.embedded import EmbeddedEngine

T = TypeVar("T")


@dataclass(frozen=True)
class GeneratedRow:
    """One decoded row: its tokens, their log-probs and the weight version that sampled each."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    token_versions: list[int]


def row_result(out_tokens: torch.Tensor, out_logprobs: torch.Tensor, row: int, length: int, is_stopped: bool,
               is_aborted: bool, step_versions: list[int]) -> GeneratedRow:
    """Row ``row`` of a chunk's ``[rows, steps]`` outputs, cut at its ``length``."""
    return GeneratedRow(
        token_ids=out_tokens[row, :length].tolist(),
        logprobs=out_logprobs[row, :length].tolist(),
        finish_reason="abort" if is_aborted else "stop" if is_stopped else "length",
        token_versions=step_versions[:length],
    )


class WeightGate:
    """Decode steps run concurrently with each other, never with a weight update (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active_steps = 0
        self._updating = False

    @contextmanager
    def step(self):
        with self._cond:
            while self._updating:
                self._cond.wait()
            self._active_steps += 1
        try:
            yield
        finally:
            with self._cond:
                self._active_steps -= 1
                self._cond.notify_all()

    def when_settled(self, read: Callable[[], T]) -> T:
        """``read()`` at a moment no weight update is in progress (waiting for one to end)."""
        with self._cond:
            while self._updating:
                self._cond.wait()
            return read()

    @contextmanager
    def exclusive(self):
        with self._cond:
            while self._updating:
                self._cond.wait()
            self._updating = True  # from here on no step starts
            while self._active_steps:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()


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
                self._add(request_index, sample_index, Sample(prompt_index=0, token_ids=[], logprobs=[],
                                                              finish_reason="abort", weight_version=self.version))
            else:
                live.append((request_index, sample_index))
        return live

    def for_chunk(self, chunk_rows: list[tuple[int, int]]) -> "ChunkListener":
        return ChunkListener(self, chunk_rows)

    def _add(self, request_index: int, sample_index: int, sample: Sample) -> None:
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
        self.rows._add(request_index, sample_index, Sample(
            prompt_index=0, token_ids=row.token_ids, logprobs=row.logprobs, finish_reason=row.finish_reason,
            weight_version=versions[0] if versions else self.rows.version, token_versions=versions))


class StreamWorker:
    """The background thread of an embedded engine's streamed requests."""

    POLL_S = 0.2  # how often an idle worker looks at the closed flag

    def __init__(self, engine: "EmbeddedEngine", book: RequestBook) -> None:
        self.engine = engine
        self.book = book
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
                    self.engine._decode_rows([r.prompt for r in group], seeds, params,
                                             StreamedRows(self.book, group, self.engine.weight_version))
        except BaseException as error:  # noqa: BLE001 - the next poll() raises it in the caller's thread
            self.book.fail(error)

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)

