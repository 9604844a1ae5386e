"""In-process rollout engine: batched KV-cached sampling on an HF-format copy of the policy (the CPU default).

The engine builds the HF model from its config (fp32, CPU, eval, no grad) and receives weights only through
:meth:`EmbeddedEngine.update_weights` — the same buckets of ``(hf_name, tensor)`` the SGLang engine receives — so the
handoff code runs in every mode.

Generation (:meth:`EmbeddedEngine.generate`) is a custom decode loop rather than ``model.generate``:

* every sample of a call is one row (all ``n`` copies of a prompt included); rows are sorted by prompt length and
  cut into chunks bounded by a row count and a KV-cache byte budget;
* a chunk is left-padded, masked and cached as :mod:`dapo_megatron.rollout.decode_batch` describes (positions that
  ignore the padding, masks that keep pad slots finite, a KV cache preallocated for the whole decode);
* the prompt goes through the HF model, once per distinct prompt (its ``n`` rows copy the cache and logits); every
  decode step after it through :mod:`dapo_megatron.rollout.lean_decode` (the model's operations without
  transformers' per-call machinery, and an attention written for one query per row; logits equal up to rounding);
* a row finishes on a stop token (kept in its ``token_ids``, reason ``"stop"``) or after ``max_new_tokens``
  (``"length"``); finished rows are dropped from the batch once they are a large enough share of it, which
  shrinks every later forward at the cost of one copy of the cache.

Log-probs and the sampling rule are documented in :mod:`dapo_megatron.rollout.sampling`: ``Sample.logprobs`` holds
``log_softmax(logits / T)`` of the chosen token before top-k/top-p truncation (the untempered distribution when
``T == 0``, i.e. greedy).

Streaming (:meth:`EmbeddedEngine.submit` / ``poll`` / ``abort``) runs the same decode loop in a background thread
(:mod:`dapo_megatron.rollout.embedded_stream`); a weight update waits for the decode step in progress, and the loops
re-prefill with the new weights before their next step (per-token versions in ``Sample.token_versions``).
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from dapo_megatron.hf_format import Bucket, bucketed, iter_tensors, load_hf_config
from dapo_megatron.rollout.decode_batch import LeftPaddedBatch, preallocated_kv_cache, prefill
from dapo_megatron.rollout.embedded_stream import (
    ChunkListener,
    GeneratedRow,
    StreamedRows,
    StreamWorker,
    WeightGate,
    row_result,
)
from dapo_megatron.rollout.engine import (
    EngineHealth,
    FinishedRequest,
    GenerationRequest,
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
)
from dapo_megatron.rollout.lean_decode import LeanDecoder
from dapo_megatron.rollout.named_tensors import load_named_tensors
from dapo_megatron.rollout.request_book import RequestBook
from dapo_megatron.rollout.sampling import (
    TokenSampler,
    per_sample_seeds,
    per_sample_uniforms,
    resolve_call_seed,
)

NO_WEIGHTS_VERSION = -1
"""``weight_version`` of an engine that has not received (valid) weights yet; :meth:`generate` refuses to run."""

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

# ----------------------------------------------------------------------------------------------------------------
# Engine


class EmbeddedEngine(RolloutEngine):
    """Rollout engine running an HF causal LM (Qwen2 / Llama family) in this process, fp32 on CPU.

    Args:
        hf_config: the model's HF config; the model is built from it with random weights, which are never used:
            :meth:`generate` refuses to run until :meth:`update_weights` has delivered a full, valid set.
        max_batch_rows: most sample rows decoded together (a chunk).
        max_kv_cache_bytes: KV-cache budget of one chunk; chunks shrink so that rows x positions fits it.
        drop_finished_fraction: finished rows leave the batch once they are at least this share of it (0: as soon as
            one finishes; above 1: never). Dropping shrinks later forwards but copies the cache.
    """

    def __init__(
        self,
        hf_config: PretrainedConfig,
        *,
        max_batch_rows: int = 512,
        max_kv_cache_bytes: int = 2 * 2**30,
        drop_finished_fraction: float = 0.25,
        host_compute: Callable[[], AbstractContextManager] = nullcontext,
    ):
        check_supported_config(hf_config)
        self._host_compute = host_compute  # the backend's context for tensor work that never names CUDA
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        config = copy.deepcopy(hf_config)
        self._model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        self._model.eval().requires_grad_(False)
        self._decode_step = LeanDecoder(self._model)  # the model's decode step without its per-call machinery
        self._config = self._model.config
        self._max_batch_rows = max_batch_rows
        self._max_kv_cache_bytes = max_kv_cache_bytes
        self._drop_finished_fraction = drop_finished_fraction
        self._version = NO_WEIGHTS_VERSION
        self._gate = WeightGate()  # decode steps vs. weight updates
        self._book = RequestBook("EmbeddedEngine")  # streamed requests
        self._worker: StreamWorker | None = None

    @classmethod
    def from_hf_directory(cls, directory: str | Path, *, version: int = 0, **engine_kwargs) -> "EmbeddedEngine":
        """Build from an HF checkpoint directory: its ``config.json``, then its safetensors weights pushed through
        :meth:`update_weights` as ``version``, one tensor per bucket."""
        engine = cls(load_hf_config(directory), **engine_kwargs)
        engine.update_weights(bucketed(iter_tensors(directory), bucket_bytes=1), version)
        return engine

    # -- weights ---------------------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        model = self._require_model()
        if version < 0:
            raise ValueError(f"EmbeddedEngine.update_weights: version must be >= 0, got {version}")
        if version < self._version:
            raise ValueError(
                f"EmbeddedEngine.update_weights: version {version} is older than the served version {self._version}"
            )
        with self._gate.exclusive():  # between two decode steps of every generation in flight
            self._version = NO_WEIGHTS_VERSION  # until the new set is fully and correctly loaded
            try:
                load_named_tensors(model, (named for bucket in buckets for named in bucket))
            except ValueError as error:
                raise ValueError(f"EmbeddedEngine.update_weights(version={version}): {error}") from None
            self._version = version

    # -- generation ------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Sample]]:
        self._require_model()
        self._require_weights("EmbeddedEngine.generate")
        self._check_generate_inputs(prompts, params)
        if not prompts:
            return []

        seeds = per_sample_seeds(resolve_call_seed(params.seed), len(prompts), params.n)
        results = self._decode_rows(prompts, seeds, params)
        return [
            [
                Sample(
                    prompt_index=prompt_index,
                    token_ids=results[prompt_index, sample_index].token_ids,
                    logprobs=results[prompt_index, sample_index].logprobs,
                    finish_reason=results[prompt_index, sample_index].finish_reason,
                    weight_version=(results[prompt_index, sample_index].token_versions or [self._version])[0],
                    token_versions=results[prompt_index, sample_index].token_versions,
                )
                for sample_index in range(params.n)
            ]
            for prompt_index in range(len(prompts))
        ]

    def _decode_rows(self, prompts: Sequence[Sequence[int]], seeds: torch.Tensor, params: SamplingParams,
                     streamed: StreamedRows | None = None) -> dict[tuple[int, int], GeneratedRow]:
        """Every (prompt, sample) row, sorted by prompt length and decoded in chunks; ``seeds[i, j]`` seeds sample
        ``j`` of prompt ``i``. ``streamed``: rows go to their requests as they finish (and aborted ones stop)."""
        model = self._require_model()
        sampler = TokenSampler.from_params(params)
        rows = sorted(
            ((prompt_index, sample_index) for prompt_index in range(len(prompts)) for sample_index in range(params.n)),
            key=lambda row: len(prompts[row[0]]),
        )
        rows_per_chunk = self._chunk_size(max(len(prompt) for prompt in prompts), params.max_new_tokens)
        results: dict[tuple[int, int], GeneratedRow] = {}
        with self._host_compute():  # HF generation never names CUDA (on CPU: no device redirect, which only slows it)
            for start in range(0, len(rows), rows_per_chunk):
                chunk_rows = rows[start : start + rows_per_chunk]
                if streamed is not None:
                    chunk_rows = streamed.live_rows(chunk_rows)
                    if not chunk_rows:
                        continue
                chunk_index = torch.tensor(chunk_rows)  # [rows, 2]: (prompt index, sample index)
                generated = self._generate_chunk(
                    model,
                    [prompts[prompt_index] for prompt_index, _ in chunk_rows],
                    seeds[chunk_index[:, 0], chunk_index[:, 1]],
                    params,
                    sampler,
                    streamed.for_chunk(chunk_rows) if streamed is not None else None,
                )
                results.update(zip(chunk_rows, generated))
        return results

    def _generate_chunk(
        self,
        model: torch.nn.Module,
        prompts: list[Sequence[int]],
        seeds: torch.Tensor,
        params: SamplingParams,
        sampler: TokenSampler,
        listener: ChunkListener | None = None,
    ) -> list[GeneratedRow]:
        """Decode one chunk of rows; see the module docstring for the padding, mask and cache layout.

        Each step runs inside the weight gate; a step that finds new weights re-prefills the prompt and the tokens
        so far with them first. ``listener`` (streaming) stops aborted rows and receives rows as they finish."""
        steps = params.max_new_tokens
        batch = LeftPaddedBatch.build(prompts, steps, pad_token_id=0)
        num_rows, padded = batch.input_ids.shape
        uniforms = None if sampler.is_greedy else per_sample_uniforms(seeds, steps)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.int64) if params.stop_token_ids else None

        out_tokens = torch.zeros(num_rows, steps, dtype=torch.int64)
        out_logprobs = torch.zeros(num_rows, steps, dtype=torch.float32)
        lengths = torch.full((num_rows,), steps, dtype=torch.int64)
        stopped = torch.zeros(num_rows, dtype=torch.bool)
        aborted = torch.zeros(num_rows, dtype=torch.bool)
        step_versions: list[int] = []  # the weight version that sampled step t's tokens
        emitted: set[int] = set()

        def emit(done_rows: torch.Tensor) -> None:  # streaming: hand finished rows over now
            for row in done_rows.tolist():
                emitted.add(row)
                listener.finished(row, row_result(out_tokens, out_logprobs, row, int(lengths[row]),
                                                         bool(stopped[row]), bool(aborted[row]), step_versions))

        # The state below shrinks when finished rows leave; `rows` maps batch rows to chunk rows.
        rows = torch.arange(num_rows)
        key_valid = batch.key_valid
        prompt_lengths = batch.prompt_lengths
        finished = torch.zeros(num_rows, dtype=torch.bool)
        cache = preallocated_kv_cache(self._config.num_hidden_layers, padded + steps - 1)

        with torch.inference_mode():
            with self._gate.step():
                version = self._version
                cache, logits = prefill(model, batch.input_ids, key_valid, cache)
            for step in range(steps):
                with self._gate.step():
                    if listener is not None:
                        newly_aborted = listener.aborted(rows) & ~finished
                        if bool(newly_aborted.any()):
                            lengths[rows[newly_aborted]] = step
                            aborted[rows[newly_aborted]] = True
                            finished |= newly_aborted
                            emit(rows[newly_aborted])
                            if bool(finished.all()):
                                break
                    if self._version != version:  # new weights since the last step: the cache holds the old ones'
                        version = self._version
                        if version == NO_WEIGHTS_VERSION:
                            raise RolloutError("a generation in flight lost its weights: the last update failed")
                        cache, logits = prefill(model, torch.cat([batch.input_ids[rows], out_tokens[rows, :step]], 1),
                                                key_valid, preallocated_kv_cache(self._config.num_hidden_layers,
                                                                                 padded + steps - 1))
                    step_versions.append(version)
                    step_uniforms = uniforms[rows, step] if uniforms is not None else None
                    tokens, logprobs = sampler(logits, step_uniforms)
                    out_tokens[rows, step] = tokens
                    out_logprobs[rows, step] = logprobs
                    if stop_ids is not None:
                        newly_stopped = torch.isin(tokens, stop_ids) & ~finished
                        if bool(newly_stopped.any()):
                            lengths[rows[newly_stopped]] = step + 1
                            stopped[rows[newly_stopped]] = True
                            finished |= newly_stopped
                            if listener is not None:
                                emit(rows[newly_stopped])
                    if step == steps - 1 or bool(finished.all()):
                        break
                    num_finished = int(finished.sum())
                    if num_finished and num_finished >= self._drop_finished_fraction * len(rows):
                        keep = (~finished).nonzero().squeeze(-1)
                        for layer in cache.layers:
                            layer.batch_select_indices(keep)
                        rows, key_valid, prompt_lengths = rows[keep], key_valid[keep], prompt_lengths[keep]
                        tokens, finished = tokens[keep], finished[keep]
                    logits = self._decode_step(
                        tokens, key_valid[:, None, None, : padded + step + 1], (prompt_lengths + step)[:, None], cache
                    )

        results = [row_result(out_tokens, out_logprobs, row, length, is_stopped, is_aborted, step_versions)
                   for row, (length, is_stopped, is_aborted)
                   in enumerate(zip(lengths.tolist(), stopped.tolist(), aborted.tolist()))]
        if listener is not None:
            for row, result in enumerate(results):
                if row not in emitted:
                    listener.finished(row, result)
        return results

    # -- streaming -------------------------------------------------------------------------------------------

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        self._require_model()
        self._require_weights("EmbeddedEngine.submit")
        for request in requests:
            self._check_generate_inputs([request.prompt], request.params)
        self._book.add(requests)
        if self._worker is None:
            self._worker = StreamWorker(self, self._book)

    def poll(self, timeout_s: float = 0.0) -> list[FinishedRequest]:
        return self._book.poll(timeout_s)

    def abort(self, request_ids: Iterable[str]) -> None:
        self._book.abort(request_ids, self._version)  # running rows stop at their next decode step

    @property
    def num_in_flight(self) -> int:
        return self._book.num_in_flight

    def _chunk_size(self, prompt_length: int, max_new_tokens: int) -> int:
        """Rows per chunk: ``max_batch_rows``, lowered so the chunk's KV cache fits ``max_kv_cache_bytes``."""
        config = self._config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bytes_per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # K+V, fp32
        bytes_per_row = bytes_per_position * (prompt_length + max_new_tokens)
        return max(1, min(self._max_batch_rows, self._max_kv_cache_bytes // bytes_per_row))

    def _check_generate_inputs(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        vocab_size = self._config.vocab_size
        max_positions = self._config.max_position_embeddings
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"EmbeddedEngine.generate: prompt {index} is empty")
            bad = [token for token in prompt if not 0 <= token < vocab_size]
            if bad:
                raise ValueError(
                    f"EmbeddedEngine.generate: prompt {index} has token ids outside [0, {vocab_size}): {bad[:10]}"
                )
            if len(prompt) + params.max_new_tokens > max_positions:
                raise ValueError(
                    f"EmbeddedEngine.generate: prompt {index} ({len(prompt)} tokens) + max_new_tokens "
                    f"({params.max_new_tokens}) exceeds max_position_embeddings ({max_positions})"
                )
        bad_stops = [token for token in params.stop_token_ids if not 0 <= token < vocab_size]
        if bad_stops:
            raise ValueError(f"EmbeddedEngine.generate: stop_token_ids outside [0, {vocab_size}): {bad_stops}")

    # -- lifecycle -------------------------------------------------------------------------------------------

    def health(self) -> EngineHealth:
        if self._model is None:
            return EngineHealth(healthy=False, weight_version=self._version, detail="shut down")
        if self._version == NO_WEIGHTS_VERSION:
            return EngineHealth(healthy=False, weight_version=self._version, detail="no weights loaded")
        return EngineHealth(healthy=True, weight_version=self._version, detail="embedded, in-process")

    def shutdown(self) -> None:
        self._book.close(self._version)
        if self._worker is not None:
            self._worker.join(timeout_s=60.0)  # it stops at its next decode step
        self._model = None

    def _require_weights(self, what: str) -> int:
        """The served version; waits out an update in progress, raises when no valid weights are loaded."""
        version = self._gate.when_settled(lambda: self._version)
        if version == NO_WEIGHTS_VERSION:
            raise RolloutError(f"{what}: no weights loaded (none yet, or the last update failed); "
                               "call update_weights first")
        return version

    def _require_model(self) -> torch.nn.Module:
        if self._model is None:
            raise RolloutError("EmbeddedEngine was shut down")
        return self._model


def check_supported_config(config: PretrainedConfig) -> None:
    """Reject configs the decode loop is not written for (other families, sliding-window attention layers)."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"EmbeddedEngine supports model types {SUPPORTED_MODEL_TYPES}, got {config.model_type!r}"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [index for index, kind in enumerate(layer_types) if kind != "full_attention"]
    if sliding:
        raise ValueError(
            f"EmbeddedEngine handles full-attention layers only; layers {sliding} are {layer_types[sliding[0]]!r}"
        )
