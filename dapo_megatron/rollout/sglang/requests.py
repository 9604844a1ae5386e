"""Translate one prompt + :class:`SamplingParams` into an SGLang ``/generate`` payload, and its reply into
:class:`Sample` objects.

One payload per prompt, carrying all ``n`` samples of that prompt:

* without a seed, ``sampling_params.n = n``: SGLang first prefills the prompt once (``max_new_tokens=0``) and then
  runs the ``n`` samples on the cached prefix (``tokenizer_manager._handle_batch_request``);
* with a seed on a server started with ``--enable-deterministic-inference``, the prompt is repeated ``n`` times
  with one ``sampling_seed`` per sample. SGLang's seeded sampler draws its Gumbel noise from
  ``hash(sampling_seed, position)``, so ``n`` copies with one seed would be ``n`` identical samples; the per-sample
  seeds are derived from ``(seed, prompt_index, sample_index)``, which makes a call reproducible. The copies still
  share the prompt's KV through the radix cache.
  SGLang ignores ``sampling_seed`` unless deterministic inference is on (``SamplingBatchInfo.from_schedule_batch``),
  and 0.5.23 allows deterministic inference only with GPU attention backends (fa3/flashinfer/triton), so on CPU a
  seed cannot make SGLang samples reproducible (see :func:`build_generate_payload`'s ``seeded``).

Streamed requests (:func:`build_stream_payload`) always send the ``n`` copies with one ``rid`` each
(``<request id>.<j>``): SGLang's ``/abort_request`` finds a request by its rid, and the sub-requests of an
``n > 1`` request get random ones. A streamed sample's per-token weight versions come from
``meta_info.weight_versions`` (spans ``{"version", "start", "end"}`` over the output tokens, recorded by the
scheduler when the version changes while the request is live; :func:`token_versions_from_meta`).

Routing (R3, ``algorithm.moe_routing_replay: replay_rollout``): with ``routed_experts`` a payload asks for
``return_routed_experts`` (``routed_experts_start_len`` 0: from the first prompt token), and each reply's
``meta_info["routed_experts"]`` is read as SGLang 0.5.23 writes it: base64 of the int32 bytes of a
``[seqlen − 1, layers, top-k]`` array (``state_capturer/base.py`` ``get_topk``, encoded in
``detokenizer_manager._b64_encode_per_request``), i.e. every prompt token and every output token but the last; it
becomes ``Sample.routed_experts`` as int16 ``[seqlen − 1, layers, top-k]``, the layout every engine's samples have. The
bytes do not say how the ids split into layers, so the reader is given the model's top-k (``num_experts_per_tok`` of
its config, the width SGLang's ``RoutedExpertsCapturer`` sizes its buffer with) and the layers are what remains. A
server started without ``--enable-return-routed-experts`` has no capturer and leaves the key out:
:func:`routed_experts_from_meta` names the flag.

Log-probabilities (``return_logprob``): SGLang 0.5.23's sampler returns ``log_softmax(logits / T)`` of the sampled
token, i.e. after temperature and before top-p/top-k truncation (``Sampler.forward``: ``logits.div_(temperatures)``,
``probs = softmax``, ``logprobs = log(probs)``; the top-k/top-p sampler sorts a copy), which is what
:class:`Sample` promises. Two exceptions: the environment variable ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` makes it
return the un-tempered ``log_softmax(logits)`` (the launcher removes it from server environments), and greedy
requests (``temperature == 0``) get ``log_softmax(logits)``, i.e. temperature 1.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from dapo_megatron.rollout.engine import FinishReason, GenerationRequest, RolloutError, Sample, SamplingParams
from dapo_megatron.config.algorithm import SGLANG_ROUTING_FLAG as ROUTING_FLAG
from dapo_megatron.hf_format import CONFIG_FILE
from dapo_megatron.user_errors import ModelFolderError, ServerError

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def per_sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one sample, a fixed function of the call's seed and the sample's position in the call."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _sglang_sampling_params(params: SamplingParams) -> dict[str, Any]:
    if params.stop_sequences and not params.stop_strings:
        raise ValueError(f"SGLang matches stops as text: stop_sequences {params.stop_sequences} need their text in "
                         "SamplingParams.stop_strings")
    # SGLang 0.5.23 ends a request once the decoded tail of its output holds a stop string
    # (Req._check_str_based_finish) and keeps output_ids up to the token that completed it (finished_len, stop
    # included), so a turn's ids end with the call's end as the embedded engine's do.
    stop = {"stop": list(params.stop_strings)} if params.stop_strings else {}
    return {**stop,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }


def build_generate_payload(prompt: Sequence[int], prompt_index: int, params: SamplingParams, *,
                           seeded: bool, routed_experts: bool = False, adapter: dict | None = None) -> dict[str, Any]:
    """The ``/generate`` body for one prompt's ``params.n`` samples.

    ``seeded``: use per-sample ``sampling_seed`` values (only meaningful when ``params.seed`` is set and the server
    runs deterministic inference); otherwise the samples share one request with ``n``. ``routed_experts``: ask for
    the routing too. ``adapter``: the LoRA adapter's fields (``{"lora_path": name}``,
    :mod:`.lora_adapters`).
    """
    if not prompt:
        raise ValueError(f"prompt {prompt_index} is empty; SGLang needs at least one input token")
    base = _sglang_sampling_params(params)
    routing = {**_routing_fields(routed_experts), **(adapter or {})}
    if seeded and params.seed is not None:
        sampling = [dict(base, n=1, sampling_seed=per_sample_seed(params.seed, prompt_index, j))
                    for j in range(params.n)]
        return {"input_ids": [list(prompt)] * params.n, "sampling_params": sampling, "return_logprob": True,
                **routing}
    return {"input_ids": [list(prompt)], "sampling_params": dict(base, n=params.n), "return_logprob": True,
            **routing}


def _routing_fields(routed_experts: bool) -> dict[str, Any]:
    return {"return_routed_experts": True, "routed_experts_start_len": 0} if routed_experts else {}


def sample_rid(request_id: str, sample_index: int) -> str:
    return f"{request_id}.{sample_index}"


def build_stream_payload(request: GenerationRequest, *, seeded: bool, routed_experts: bool = False,
                         adapter: dict | None = None) -> dict[str, Any]:
    """The ``/generate`` body of a streamed request: its ``n`` samples as copies of the prompt, one rid each (and
    the LoRA adapter's fields, ``adapter``)."""
    params = request.params
    base = dict(_sglang_sampling_params(params), n=1)
    sampling = [dict(base, sampling_seed=per_sample_seed(params.seed, 0, j)) if seeded and params.seed is not None
                else base for j in range(params.n)]
    return {"input_ids": [list(request.prompt)] * params.n, "sampling_params": sampling, "return_logprob": True,
            "rid": [sample_rid(request.request_id, j) for j in range(params.n)], **_routing_fields(routed_experts),
            **(adapter or {})}


def routed_experts_from_meta(meta_info: dict[str, Any], *, tokens: int, topk: int, server: str,
                             what: Any) -> torch.Tensor:
    """``meta_info["routed_experts"]`` of a reply with ``tokens`` prompt + output tokens as int16
    ``[tokens − 1, layers, topk]`` (see the module docstring)."""
    encoded = meta_info.get("routed_experts")
    if encoded is None:
        raise ServerError(f"{server} returned no routed experts for {what}: algorithm.moe_routing_replay: "
                          f"replay_rollout needs servers started with {ROUTING_FLAG} "
                          "(rollout.sglang.extra_server_args)")
    ids = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    rows = tokens - 1
    if rows < 1 or ids.size % (rows * topk):
        raise RolloutError(f"{server}: {ids.size} routed expert ids for {what} do not split over {rows} tokens "
                           f"× top-{topk}")
    return torch.from_numpy(ids.astype(np.int16)).reshape(rows, ids.size // (rows * topk), topk)


def routing_topk(model_path: str | Path) -> int:
    """The experts each token is routed to by the served model: ``num_experts_per_tok`` of its ``config.json``, the
    width of SGLang 0.5.23's routed-experts buffer (``RoutedExpertsCapturer``), which a reply's ids are read with."""
    config = json.loads(Path(model_path, CONFIG_FILE).read_text())
    topk = config.get("num_experts_per_tok")
    if not isinstance(topk, int) or topk < 1:
        raise ModelFolderError(f"{Path(model_path, CONFIG_FILE)}: algorithm.moe_routing_replay: replay_rollout reads "
                               f"the servers' routing with the model's num_experts_per_tok, and it has {topk!r}")
    return topk


def token_versions_from_meta(meta_info: dict[str, Any], num_tokens: int, server: str) -> list[int]:
    """The weight version of each output token, from ``meta_info.weight_versions`` (else ``weight_version``)."""
    spans = meta_info.get("weight_versions")
    if not spans:
        return [_version_number(meta_info.get("weight_version"), server)] * num_tokens
    versions: list[int] = []
    for span in spans:
        if span["start"] != len(versions):
            raise RolloutError(f"{server}: weight-version spans {spans} do not tile the {num_tokens} output tokens")
        versions.extend([_version_number(span["version"], server)] * (span["end"] - span["start"]))
    if len(versions) != num_tokens:
        raise RolloutError(f"{server}: weight-version spans {spans} cover {len(versions)} of {num_tokens} tokens")
    return versions


def _version_number(version: Any, server: str) -> int:
    if not str(version).isdigit():
        raise RolloutError(f"{server} reports weight version {version!r}; the engine tags versions 0, 1, 2, ...")
    return int(version)


def finish_reason_from_sglang(meta_info: dict[str, Any]) -> FinishReason:
    """SGLang's ``meta_info.finish_reason`` (``{"type": "stop"|"length"|"abort", ...}``) as ours."""
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return _FINISH_REASONS.get(kind, "abort")


def samples_from_outputs(outputs: list[dict[str, Any]], prompt_index: int, expected_count: int,
                         expected_version: int, server: str, routed_prompt_length: int | None = None,
                         routed_topk: int = 0) -> list[Sample]:
    """Parse the outputs of one prompt's payload; check count and served weight version. ``routed_prompt_length``:
    the payload asked for routing, of a prompt this long, by a model routing each token to ``routed_topk``
    experts."""
    if len(outputs) != expected_count:
        raise RolloutError(f"{server} returned {len(outputs)} outputs for prompt {prompt_index}, "
                           f"expected {expected_count}")
    samples = []
    for output in outputs:
        meta = output.get("meta_info", {})
        served = str(meta.get("weight_version"))
        if served != str(expected_version):
            raise RolloutError(f"{server} generated prompt {prompt_index} with weight_version {served!r}, "
                               f"but the engine pushed version {expected_version}")
        token_ids, logprobs = _tokens_and_logprobs(output, meta, f"prompt {prompt_index}", server)
        routing = None if routed_prompt_length is None else routed_experts_from_meta(
            meta, tokens=routed_prompt_length + len(token_ids), topk=routed_topk, server=server,
            what=f"prompt {prompt_index}")
        samples.append(Sample(prompt_index=prompt_index, token_ids=token_ids, logprobs=logprobs,
                              finish_reason=finish_reason_from_sglang(meta), weight_version=expected_version,
                              token_versions=[expected_version] * len(token_ids), routed_experts=routing))
    return samples


def streamed_samples(outputs: list[dict[str, Any]], request: GenerationRequest, server: str,
                     routed_topk: int | None = None, adapter_version: int | None = None) -> list[Sample]:
    """The samples of a streamed request's reply, with per-token weight versions (they may span updates) and, when
    the payload asked for it (``routed_topk``: the model's top-k), the routing. ``adapter_version``: the request named
    that LoRA adapter, which sampled every one of its tokens (:mod:`.lora_adapters`), whatever the server's version
    tag said meanwhile."""
    if len(outputs) != request.params.n:
        raise RolloutError(f"{server} returned {len(outputs)} outputs for request {request.request_id}, "
                           f"expected {request.params.n}")
    samples = []
    for output in outputs:
        meta = output.get("meta_info", {})
        token_ids, logprobs = _tokens_and_logprobs(output, meta, request.request_id, server)
        versions = (token_versions_from_meta(meta, len(token_ids), server) if adapter_version is None
                    else [adapter_version] * len(token_ids))
        first = adapter_version if adapter_version is not None else (
            versions[0] if versions else _version_number(meta.get("weight_version"), server))
        routing = None
        if routed_topk and token_ids:
            routing = routed_experts_from_meta(meta, tokens=len(request.prompt) + len(token_ids), topk=routed_topk,
                                               server=server, what=request.request_id)
        samples.append(Sample(prompt_index=0, token_ids=token_ids, logprobs=logprobs,
                              finish_reason=finish_reason_from_sglang(meta), weight_version=first,
                              token_versions=versions, routed_experts=routing))
    return samples


def _tokens_and_logprobs(output: dict[str, Any], meta: dict[str, Any], what: Any, server: str):
    token_ids = [int(t) for t in output["output_ids"]]
    logprob_entries = meta.get("output_token_logprobs") or []
    if [int(entry[1]) for entry in logprob_entries] != token_ids:
        raise RolloutError(f"{server}: log-prob token ids disagree with output_ids for {what}")
    return token_ids, [float(entry[0]) for entry in logprob_entries]
