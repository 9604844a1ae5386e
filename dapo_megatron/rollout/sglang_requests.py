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

Log-probabilities (``return_logprob``): SGLang 0.5.23's sampler returns ``log_softmax(logits / T)`` of the sampled
token, i.e. after temperature and before top-p/top-k truncation (``Sampler.forward``: ``logits.div_(temperatures)``,
``probs = softmax``, ``logprobs = log(probs)``; the top-k/top-p sampler sorts a copy), which is what
:class:`Sample` promises. Two exceptions: the environment variable ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` makes it
return the un-tempered ``log_softmax(logits)`` (the launcher removes it from server environments), and greedy
requests (``temperature == 0``) get ``log_softmax(logits)``, i.e. temperature 1.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from dapo_megatron.rollout.engine import FinishReason, RolloutError, Sample, SamplingParams

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def per_sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one sample, a fixed function of the call's seed and the sample's position in the call."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _sglang_sampling_params(params: SamplingParams) -> dict[str, Any]:
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }


def build_generate_payload(prompt: Sequence[int], prompt_index: int, params: SamplingParams, *,
                           seeded: bool) -> dict[str, Any]:
    """The ``/generate`` body for one prompt's ``params.n`` samples.

    ``seeded``: use per-sample ``sampling_seed`` values (only meaningful when ``params.seed`` is set and the server
    runs deterministic inference); otherwise the samples share one request with ``n``.
    """
    if not prompt:
        raise ValueError(f"prompt {prompt_index} is empty; SGLang needs at least one input token")
    base = _sglang_sampling_params(params)
    if seeded and params.seed is not None:
        sampling = [dict(base, n=1, sampling_seed=per_sample_seed(params.seed, prompt_index, j))
                    for j in range(params.n)]
        return {"input_ids": [list(prompt)] * params.n, "sampling_params": sampling, "return_logprob": True}
    return {"input_ids": [list(prompt)], "sampling_params": dict(base, n=params.n), "return_logprob": True}


def finish_reason_from_sglang(meta_info: dict[str, Any]) -> FinishReason:
    """SGLang's ``meta_info.finish_reason`` (``{"type": "stop"|"length"|"abort", ...}``) as ours."""
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return _FINISH_REASONS.get(kind, "abort")


def samples_from_outputs(outputs: list[dict[str, Any]], prompt_index: int, expected_count: int,
                         expected_version: int, server: str) -> list[Sample]:
    """Parse the outputs of one prompt's payload; check count and served weight version."""
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
        token_ids = [int(t) for t in output["output_ids"]]
        logprob_entries = meta.get("output_token_logprobs") or []
        logprobs = [float(entry[0]) for entry in logprob_entries]
        if [int(entry[1]) for entry in logprob_entries] != token_ids:
            raise RolloutError(f"{server}: log-prob token ids disagree with output_ids for prompt {prompt_index}")
        samples.append(Sample(prompt_index=prompt_index, token_ids=token_ids, logprobs=logprobs,
                              finish_reason=finish_reason_from_sglang(meta), weight_version=expected_version))
    return samples
