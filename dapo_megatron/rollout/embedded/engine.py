"""In-process rollout engine: batched KV-cached sampling on an HF-format copy of the policy (the CPU default).

The engine builds the HF model from its config (fp32, CPU, eval, no grad) and receives weights only through
:meth:`EmbeddedEngine.update_weights` — the same buckets of ``(hf_name, tensor)`` the SGLang engine receives — so the
handoff code runs in every mode.

Generation (:meth:`EmbeddedEngine.generate`) is a custom decode loop rather than ``model.generate``:

* every sample of a call is one row (all ``n`` copies of a prompt included); rows are sorted by prompt length and
  cut into chunks bounded by a row count and a KV-cache byte budget;
* a chunk is left-padded, masked and cached as :mod:`.decode_batch` describes (positions that
  ignore the padding, masks that keep pad slots finite, a KV cache preallocated for the whole decode);
* the prompt goes through the HF model, once per distinct prompt (its ``n`` rows copy the cache and logits); every
  decode step after it through :mod:`.lean_decode` (dense models: the model's operations
  without transformers' per-call machinery, and an attention written for one query per row; logits equal up to
  rounding; mixture-of-experts models: the model's own forward);
* a row finishes on a stop token or when its generated tokens end with one of ``stop_sequences`` (kept in its
  ``token_ids``, reason ``"stop"``) or after ``max_new_tokens``
  (``"length"``); finished rows are dropped from the batch once they are a large enough share of it, which
  shrinks every later forward at the cost of one copy of the cache. The steps of one chunk's decode:
  :mod:`.decode_chunk`.

How it batches (rows per chunk, the KV-cache budget, when finished rows leave) is the run config's
``rollout.embedded`` section (:class:`dapo_megatron.config.EmbeddedConfig`).

Log-probs and the sampling rule are documented in :mod:`dapo_megatron.rollout.sampling`: ``Sample.logprobs`` holds
``log_softmax(logits / T)`` of the chosen token before top-k/top-p truncation (the untempered distribution when
``T == 0``, i.e. greedy).

Streaming (:meth:`EmbeddedEngine.submit` / ``poll`` / ``abort``) runs the same decode loop in a background thread
(:mod:`.stream`); a weight update waits for the decode step in progress
(:mod:`.weight_gate`), and the loops re-prefill with the new weights before their next step
(per-token versions in ``Sample.token_versions``).
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from dapo_megatron.config import EmbeddedConfig
from dapo_megatron.hf_format import Bucket, bucketed, iter_tensors, load_hf_config
from dapo_megatron.hf_format.peft_adapter import PeftAdapter
from dapo_megatron.rollout.embedded.adapter_merge import AdapterMerge
from dapo_megatron.rollout.embedded.decode_chunk import DecodingChunk, GeneratedRow
from dapo_megatron.rollout.embedded.stream import StreamedRows, StreamWorker
from dapo_megatron.rollout.engine import (
    EngineHealth,
    FinishedRequest,
    GenerationRequest,
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
)
from dapo_megatron.rollout.embedded.lean_decode import decode_step_for
from dapo_megatron.rollout.embedded.named_tensors import load_named_tensors
from dapo_megatron.rollout.embedded.routing_capture import RoutingCapture
from dapo_megatron.rollout.request_book import RequestBook
from dapo_megatron.rollout.sampling import TokenSampler, per_sample_seeds, resolve_call_seed
from dapo_megatron.rollout.embedded.weight_gate import WeightGate

NO_WEIGHTS_VERSION = -1
"""``weight_version`` of an engine that has not received (valid) weights yet; :meth:`generate` refuses to run."""

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")

# ----------------------------------------------------------------------------------------------------------------
# Engine


class EmbeddedEngine(RolloutEngine):
    """Rollout engine running an HF causal LM (Qwen2 / Llama / Qwen3 / Qwen3-MoE) in this process, fp32 on CPU.

    Args:
        hf_config: the model's HF config; the model is built from it with random weights, which are never used:
            :meth:`generate` refuses to run until :meth:`update_weights` has delivered a full, valid set.
        settings: how it batches (the run config's ``rollout.embedded``); None: the schema's defaults.
        gate: what decode steps and weight updates take turns through; a test passes one that holds the decode loop
            at a chosen step. None: a plain :class:`WeightGate`.
    """

    def __init__(self, hf_config: PretrainedConfig, settings: EmbeddedConfig | None = None, *,
                 gate: WeightGate | None = None, host_compute: Callable[[], AbstractContextManager] = nullcontext):
        check_supported_config(hf_config)
        self.settings = settings or EmbeddedConfig()
        if self.settings.max_batch_rows < 1:
            raise ValueError(f"EmbeddedEngine: max_batch_rows must be >= 1, got {self.settings.max_batch_rows}")
        self._host_compute = host_compute  # the backend's context for tensor work that never names CUDA
        config = copy.deepcopy(hf_config)
        self._model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        self._model.eval().requires_grad_(False)
        self.decode_step = decode_step_for(self._model)  # without transformers' per-call machinery where it can
        self._config = self._model.config
        self._version = NO_WEIGHTS_VERSION
        self._gate = gate or WeightGate()  # decode steps vs. weight updates
        self._book = RequestBook("EmbeddedEngine")  # streamed requests
        self._worker: StreamWorker | None = None
        # algorithm.moe_routing_replay: replay_rollout sets it: every sample carries its routing (routing_capture.py)
        self.return_routed_experts = False
        self._capture: RoutingCapture | None = None
        self._adapters = AdapterMerge()  # LoRA adapters merged into the weights (adapter_merge.py)

    @classmethod
    def from_hf_directory(cls, directory: str | Path, settings: EmbeddedConfig | None = None, *, version: int = 0,
                          gate: WeightGate | None = None) -> "EmbeddedEngine":
        """Build from an HF checkpoint directory: its ``config.json``, then its safetensors weights pushed through
        :meth:`update_weights` as ``version``, one tensor per bucket."""
        engine = cls(load_hf_config(directory), settings, gate=gate)
        engine.update_weights(bucketed(iter_tensors(directory), bucket_bytes=1), version)
        return engine

    @property
    def model(self) -> torch.nn.Module:
        """The HF model it decodes with (fp32, eval mode, no grad), holding the served weights."""
        return self._require_model()

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
            self._adapters.new_base()
            try:
                load_named_tensors(model, (named for bucket in buckets for named in bucket))
            except ValueError as error:
                raise ValueError(f"EmbeddedEngine.update_weights(version={version}): {error}") from None
            self._version = version

    def update_adapter(self, adapter: PeftAdapter, version: int) -> None:
        """Merge the LoRA ``adapter`` into the base weights of the last :meth:`update_weights` and serve them as
        ``version`` (:mod:`.adapter_merge`); generations in flight continue on them as after a weight update."""
        model = self._require_model()
        self._require_weights("EmbeddedEngine.update_adapter")
        if version < self._version:
            raise ValueError(f"EmbeddedEngine.update_adapter: version {version} is older than the served version "
                             f"{self._version}")
        with self._gate.exclusive():
            served, self._version = self._version, NO_WEIGHTS_VERSION
            try:
                self._adapters.apply(model, adapter)
            except ValueError as error:
                self._version = served  # nothing was changed: the check comes first
                raise ValueError(f"EmbeddedEngine.update_adapter(version={version}): {error}") from None
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
                    routed_experts=results[prompt_index, sample_index].routed_experts,
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
                generated = self._decode_chunk(
                    model,
                    DecodingChunk([prompts[prompt_index] for prompt_index, _ in chunk_rows],
                                  seeds[chunk_index[:, 0], chunk_index[:, 1]], params, sampler,
                                  num_layers=self._config.num_hidden_layers,
                                  listener=streamed.for_chunk(chunk_rows) if streamed is not None else None,
                                  capture=self._routing_capture()),
                )
                results.update(zip(chunk_rows, generated))
        return results

    def _routing_capture(self) -> RoutingCapture | None:
        """The routers' hooks, made at the first generation that asks for routing (None otherwise)."""
        if self.return_routed_experts and self._capture is None:
            self._capture = RoutingCapture(self._require_model())
        return self._capture if self.return_routed_experts else None

    def _decode_chunk(self, model: torch.nn.Module, chunk: DecodingChunk) -> list[GeneratedRow]:
        """Run ``chunk``'s decode steps (:mod:`.decode_chunk`), each inside the weight gate; a
        step that finds new weights re-prefills the prompts and the tokens so far with them first."""
        with torch.inference_mode():
            with self._gate.step():
                version = self._version
                chunk.prefill(model)
            for step in range(chunk.steps):
                with self._gate.step():
                    chunk.stop_aborted_rows(step)
                    if chunk.all_finished:
                        break
                    if self._version != version:  # new weights since the last step: the cache holds the old ones'
                        version = self._version
                        if version == NO_WEIGHTS_VERSION:
                            raise RolloutError("a generation in flight lost its weights: the last update failed")
                        chunk.re_prefill(model, step)
                    chunk.sample(step, version)
                    chunk.stop_at_stop_tokens(step)
                    if step == chunk.steps - 1 or chunk.all_finished:
                        break
                    chunk.drop_finished_rows(self.settings.drop_finished_fraction)
                    chunk.decode(self.decode_step, step)
        return chunk.results()

    # -- streaming -------------------------------------------------------------------------------------------

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        self._require_model()
        self._require_weights("EmbeddedEngine.submit")
        for request in requests:
            self._check_generate_inputs([request.prompt], request.params)
        self._book.add(requests)
        if self._worker is None:
            self._worker = StreamWorker(self._book, decode_rows=self._decode_rows, served_version=lambda: self._version)

    def poll(self, timeout_s: float = 0.0) -> list[FinishedRequest]:
        return self._book.poll(timeout_s)

    def abort(self, request_ids: Iterable[str]) -> None:
        self._book.abort(request_ids, self._version)  # running rows stop at their next decode step

    @property
    def num_in_flight(self) -> int:
        return self._book.num_in_flight

    def _chunk_size(self, prompt_length: int, max_new_tokens: int) -> int:
        """Rows per chunk: ``max_batch_rows``, lowered so the chunk's KV cache fits ``max_kv_cache_mb``."""
        config = self._config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bytes_per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # K+V, fp32
        bytes_per_row = bytes_per_position * (prompt_length + max_new_tokens)
        max_kv_cache_bytes = int(self.settings.max_kv_cache_mb * 2**20)
        return max(1, min(self.settings.max_batch_rows, max_kv_cache_bytes // bytes_per_row))

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
        bad_sequences = [seq for seq in params.stop_sequences if not all(0 <= token < vocab_size for token in seq)]
        if bad_sequences:
            raise ValueError(f"EmbeddedEngine.generate: stop_sequences with ids outside [0, {vocab_size}): "
                             f"{bad_sequences}")

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
