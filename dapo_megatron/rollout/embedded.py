"""In-process rollout engine: batched KV-cached sampling on an HF-format copy of the policy (the CPU default).

The engine builds the HF model from its config (fp32, CPU, eval, no grad) and receives weights only through
:meth:`EmbeddedEngine.update_weights` — the same buckets of ``(hf_name, tensor)`` the SGLang engine receives — so the
handoff code runs in every mode.

Generation (:meth:`EmbeddedEngine.generate`) is a custom decode loop rather than ``model.generate``:

* every sample of a call is one row (all ``n`` copies of a prompt included); rows are sorted by prompt length and
  cut into chunks bounded by a row count and a KV-cache byte budget;
* a chunk is left-padded, masked and cached as :mod:`dapo_megatron.rollout.decode_batch` describes (positions that
  ignore the padding, masks that keep pad slots finite, a KV cache preallocated for the whole decode);
* the prompt goes through the HF model; every decode step after it through :mod:`dapo_megatron.rollout.lean_decode`
  (the same operations without transformers' per-call machinery, bit-identical logits);
* a row finishes on a stop token (kept in its ``token_ids``, reason ``"stop"``) or after ``max_new_tokens``
  (``"length"``); finished rows are dropped from the batch once they are a large enough share of it, which
  shrinks every later forward at the cost of one copy of the cache.

Log-probs and the sampling rule are documented in :mod:`dapo_megatron.rollout.sampling`: ``Sample.logprobs`` holds
``log_softmax(logits / T)`` of the chosen token before top-k/top-p truncation (the untempered distribution when
``T == 0``, i.e. greedy).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from dapo_megatron import cpu_compat
from dapo_megatron.hf_format import Bucket, TensorMismatch, WrongShape, bucketed, iter_tensors, load_hf_config
from dapo_megatron.rollout.decode_batch import LeftPaddedBatch, preallocated_kv_cache
from dapo_megatron.rollout.engine import (
    EngineHealth,
    FinishReason,
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
)
from dapo_megatron.rollout.lean_decode import LeanDecoder
from dapo_megatron.rollout.sampling import (
    TokenSampler,
    per_sample_seeds,
    per_sample_uniforms,
    resolve_call_seed,
)

NO_WEIGHTS_VERSION = -1
"""``weight_version`` of an engine that has not received (valid) weights yet; :meth:`generate` refuses to run."""

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

_MAX_NAMES_IN_ERROR = 20


# ----------------------------------------------------------------------------------------------------------------
# Weight handoff


def load_named_tensors(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy full HF-named tensors into ``model``'s parameters, checking that they match it exactly.

    Every parameter must be provided once, with its exact shape, as a finite floating-point tensor. A parameter
    shared under several names (``lm_head.weight`` tied to ``model.embed_tokens.weight``) needs only one of them; if
    several are sent they must be equal. Tensors are copied (cast to the parameter's dtype) one at a time as the
    iterator yields them, so memory stays at what the producer holds beyond the model. All problems are collected
    and raised together as one ``ValueError`` naming the tensors; the model is then partially overwritten and must
    not serve.
    """
    name_to_param = dict(model.named_parameters(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for name, param in name_to_param.items():
        aliases.setdefault(id(param), []).append(name)

    received: set[str] = set()
    provided_twice: list[str] = []
    unexpected: list[str] = []
    wrong_shape: list[WrongShape] = []
    bad_values: list[str] = []
    tied_disagree: list[str] = []
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name in received:
                provided_twice.append(name)
                continue
            received.add(name)
            param = name_to_param.get(name)
            if param is None:
                unexpected.append(f"{name} {tuple(tensor.shape)}")
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                wrong_shape.append(WrongShape(name, tuple(tensor.shape), tuple(param.shape)))
                continue
            if not tensor.is_floating_point():
                bad_values.append(f"{name}: dtype {tensor.dtype} is not floating point")
                continue
            if not _all_finite(tensor):
                bad_values.append(f"{name}: contains NaN or inf")
                continue
            already_loaded = [alias for alias in aliases[id(param)] if alias != name and alias in received]
            if already_loaded and not torch.equal(param, tensor.to(param.dtype)):
                tied_disagree.append(f"{name} differs from {already_loaded[0]} (the model ties them)")
                continue
            param.copy_(tensor)

    mismatch = TensorMismatch(
        missing=[" / ".join(names) for names in aliases.values() if not any(name in received for name in names)],
        unexpected=unexpected,
        wrong_shape=wrong_shape,
        other={"provided more than once": provided_twice, "bad values": bad_values,
               "tied weights disagree": tied_disagree},
    )
    if mismatch:
        raise ValueError(mismatch.report(f"the tensors do not match {type(model).__name__}",
                                         max_names=_MAX_NAMES_IN_ERROR))


def _all_finite(tensor: torch.Tensor) -> bool:
    """NaN and ±inf reach the minimum or maximum: one read pass, no temporary the size of the tensor (which
    ``isfinite(t).all()`` makes, at several times the cost of the copy into the parameter)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


# ----------------------------------------------------------------------------------------------------------------
# Engine


@dataclass(frozen=True)
class GeneratedRow:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


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
    ):
        check_supported_config(hf_config)
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        config = copy.deepcopy(hf_config)
        self._model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        self._model.eval().requires_grad_(False)
        self._config = self._model.config
        self._decode_step = LeanDecoder(self._model)  # the model's decode step without its per-call machinery
        self._max_batch_rows = max_batch_rows
        self._max_kv_cache_bytes = max_kv_cache_bytes
        self._drop_finished_fraction = drop_finished_fraction
        self._version = NO_WEIGHTS_VERSION

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
        self._version = NO_WEIGHTS_VERSION  # until the new set is fully and correctly loaded
        try:
            load_named_tensors(model, (named for bucket in buckets for named in bucket))
        except ValueError as error:
            raise ValueError(f"EmbeddedEngine.update_weights(version={version}): {error}") from None
        self._version = version

    # -- generation ------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Sample]]:
        model = self._require_model()
        if self._version == NO_WEIGHTS_VERSION:
            raise RolloutError("EmbeddedEngine.generate: no weights loaded; call update_weights first")
        self._check_generate_inputs(prompts, params)
        if not prompts:
            return []

        seeds = per_sample_seeds(resolve_call_seed(params.seed), len(prompts), params.n)
        sampler = TokenSampler.from_params(params)
        rows = sorted(
            ((prompt_index, sample_index) for prompt_index in range(len(prompts)) for sample_index in range(params.n)),
            key=lambda row: len(prompts[row[0]]),
        )
        rows_per_chunk = self._chunk_size(max(len(prompt) for prompt in prompts), params.max_new_tokens)
        results: dict[tuple[int, int], GeneratedRow] = {}
        with cpu_compat.suspended():  # HF generation never names CUDA: the device redirect would only slow it down
            for start in range(0, len(rows), rows_per_chunk):
                chunk_rows = rows[start : start + rows_per_chunk]
                chunk_index = torch.tensor(chunk_rows)  # [rows, 2]: (prompt index, sample index)
                generated = self._generate_chunk(
                    model,
                    [prompts[prompt_index] for prompt_index, _ in chunk_rows],
                    seeds[chunk_index[:, 0], chunk_index[:, 1]],
                    params,
                    sampler,
                )
                results.update(zip(chunk_rows, generated))

        return [
            [
                Sample(
                    prompt_index=prompt_index,
                    token_ids=results[prompt_index, sample_index].token_ids,
                    logprobs=results[prompt_index, sample_index].logprobs,
                    finish_reason=results[prompt_index, sample_index].finish_reason,
                    weight_version=self._version,
                )
                for sample_index in range(params.n)
            ]
            for prompt_index in range(len(prompts))
        ]

    def _generate_chunk(
        self,
        model: torch.nn.Module,
        prompts: list[Sequence[int]],
        seeds: torch.Tensor,
        params: SamplingParams,
        sampler: TokenSampler,
    ) -> list[GeneratedRow]:
        """Decode one chunk of rows; see the module docstring for the padding, mask and cache layout."""
        steps = params.max_new_tokens
        batch = LeftPaddedBatch.build(prompts, steps, pad_token_id=0)
        num_rows, padded = batch.input_ids.shape
        uniforms = None if sampler.is_greedy else per_sample_uniforms(seeds, steps)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.int64) if params.stop_token_ids else None

        out_tokens = torch.zeros(num_rows, steps, dtype=torch.int64)
        out_logprobs = torch.zeros(num_rows, steps, dtype=torch.float32)
        lengths = torch.full((num_rows,), steps, dtype=torch.int64)
        stopped = torch.zeros(num_rows, dtype=torch.bool)

        # The state below shrinks when finished rows leave; `rows` maps batch rows to chunk rows.
        rows = torch.arange(num_rows)
        key_valid = batch.key_valid
        prompt_lengths = batch.prompt_lengths
        finished = torch.zeros(num_rows, dtype=torch.bool)
        cache = preallocated_kv_cache(self._config.num_hidden_layers, padded + steps - 1)

        with torch.inference_mode():
            logits = model(
                input_ids=batch.input_ids,
                attention_mask=batch.prompt_attention_mask(),
                position_ids=batch.prompt_position_ids(),
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            for step in range(steps):
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

        token_lists = out_tokens.tolist()
        logprob_lists = out_logprobs.tolist()
        return [
            GeneratedRow(
                token_ids=token_lists[row][:length],
                logprobs=logprob_lists[row][:length],
                finish_reason="stop" if is_stopped else "length",
            )
            for row, (length, is_stopped) in enumerate(zip(lengths.tolist(), stopped.tolist()))
        ]

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
        self._model = None

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
