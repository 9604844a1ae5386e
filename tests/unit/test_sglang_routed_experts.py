"""R3 on SGLang: the request asks for the routing, and the reply's ``meta_info["routed_experts"]`` is read in the
format SGLang 0.5.23 writes (int32 ``[seqlen − 1, layers, k]`` from ``state_capturer/base.py``'s ``get_topk``,
base64-encoded by ``DetokenizerManager._b64_encode_per_request``, the encoder the server runs), then laid out by the
trainer. The CPU server itself cannot capture routing (``--enable-return-routed-experts`` makes it die at start:
``pool_host/common.py`` registers the routed-experts host buffer with CUDA), so no live server answers here."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dapo_megatron.backend_registry import select_backend
from dapo_megatron.collectors.batch import pack_rollout_batch, unpack_rollout_batch
from dapo_megatron.collectors.group import RolloutGroup
from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.policy.rollout_routing import routing_layout
from dapo_megatron.rollout import GenerationRequest, RolloutError, SamplingParams
from dapo_megatron.rollout.sglang.reply_workers import _compact, _sample
from dapo_megatron.rollout.sglang.requests import (
    build_generate_payload,
    build_stream_payload,
    routed_experts_from_meta,
    routing_topk,
    samples_from_outputs,
    streamed_samples,
)
from dapo_megatron.run.input_checks import check_rollout_routing
from dapo_megatron.user_errors import ModelFolderError, ServerError

LAYERS, TOPK = 3, 2
PROMPT = [5, 6, 7, 8]


def sglang_encoded(routing: torch.Tensor) -> str:
    detokenizer = pytest.importorskip("sglang.srt.managers.detokenizer_manager")
    return detokenizer.DetokenizerManager._b64_encode_per_request([routing])[0]


def reply(output_ids: list[int], routing: torch.Tensor | None, version: int = 0) -> dict:
    meta = {"weight_version": str(version), "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.5, token, None] for token in output_ids]}
    if routing is not None:
        meta["routed_experts"] = sglang_encoded(routing)
    return {"output_ids": output_ids, "meta_info": meta}


def test_payloads_ask_for_the_routing_from_the_first_prompt_token_only_when_told():
    params = SamplingParams(n=2, max_new_tokens=4)
    asked = build_generate_payload(PROMPT, 0, params, seeded=False, routed_experts=True)
    assert asked["return_routed_experts"] is True and asked["routed_experts_start_len"] == 0
    assert "return_routed_experts" not in build_generate_payload(PROMPT, 0, params, seeded=False)  # control
    streamed = build_stream_payload(GenerationRequest("r", tuple(PROMPT), params), seeded=False, routed_experts=True)
    assert streamed["return_routed_experts"] is True


def test_a_reply_in_sglangs_format_becomes_each_samples_routing_and_its_layout():
    output = [9, 10, 11]
    seqlen = len(PROMPT) + len(output)
    routing = torch.randint(0, 6, (seqlen - 1, LAYERS, TOPK), dtype=torch.int32)  # get_topk: tokens [0, seqlen-1)
    samples = samples_from_outputs([reply(output, routing)], 0, 1, 0, "s", routed_prompt_length=len(PROMPT),
                                   routed_topk=TOPK)
    got = samples[0].routed_experts
    assert got.dtype == torch.int16 and torch.equal(got, routing.to(torch.int16))  # [seqlen - 1, layers, k]
    laid_out = routing_layout(got, prompt_length=len(PROMPT), response_length=len(output), layers=LAYERS, topk=TOPK,
                              where="x")
    assert torch.equal(laid_out, routing.to(torch.int16))
    # the reply workers' processes hand it over unchanged
    assert torch.equal(_sample(_compact(samples[0])).routed_experts, got)
    request = GenerationRequest("r", tuple(PROMPT), SamplingParams(n=1, max_new_tokens=4))
    streamed = streamed_samples([reply(output, routing)], request, "s", routed_topk=TOPK)
    assert torch.equal(streamed[0].routed_experts, got)
    assert samples_from_outputs([reply(output, routing)], 0, 1, 0, "s")[0].routed_experts is None  # not asked


def test_sglang_replies_cross_the_rollout_batch_to_every_rank_in_the_trainers_layout():
    """Issue 40.1: the reply's routing went into the batch as ``[tokens, layers · k]`` and every rank died unpacking
    it (IndexError on ``routing_shape[1]``). Two prompts of two samples, every reply built as SGLang encodes it."""
    groups, sent = [], []
    for prompt_index, outputs in enumerate([[[9, 10, 11], [12]], [[13, 14], [15, 16, 17, 18]]]):
        prompt = PROMPT[:3 + prompt_index]
        routings = [torch.randint(0, 6, (len(prompt) + len(o) - 1, LAYERS, TOPK), dtype=torch.int32) for o in outputs]
        samples = [samples_from_outputs([reply(o, r)], prompt_index, 1, 0, "s", routed_prompt_length=len(prompt),
                                        routed_topk=TOPK)[0] for o, r in zip(outputs, routings)]
        groups.append(RolloutGroup(
            prompt_ids=prompt, ground_truth="1", data_source="t", weight_version=0,
            responses=[s.token_ids for s in samples], engine_logprobs=[s.logprobs for s in samples],
            finish_reasons=["stop"] * 2, accs=[True, False], scores=[1.0, -1.0], overlong_penalties=[0.0] * 2,
            routed_experts=[s.routed_experts for s in samples]))
        sent.append(routings)
    unpacked, _ = unpack_rollout_batch(pack_rollout_batch(groups, {}))
    for group, routings in zip(unpacked, sent):
        for index, routing in enumerate(routings):
            laid_out = routing_layout(group.routed_experts[index], prompt_length=len(group.prompt_ids),
                                      response_length=len(group.responses[index]), layers=LAYERS, topk=TOPK,
                                      where=f"response {index}")
            assert torch.equal(laid_out, routing.to(torch.int16))
    flat = [g.routed_experts[0].reshape(g.routed_experts[0].shape[0], -1) for g in groups[:1]]  # the old layout
    with pytest.raises(ValueError, match=r"routed experts of shape \(5, 6\); each response's must be \[tokens, "
                                         r"layers, top-k\]"):
        pack_rollout_batch([dataclasses.replace(groups[0], routed_experts=flat + groups[0].routed_experts[1:])], {})


def test_the_engine_reads_the_top_k_the_servers_route_with_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 8, "num_hidden_layers": 48}))
    assert routing_topk(tmp_path) == 8
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 48}))  # a dense model
    with pytest.raises(ModelFolderError, match="replay_rollout reads the servers' routing with the model's "
                                               "num_experts_per_tok, and it has None"):
        routing_topk(tmp_path)


def test_a_server_started_without_the_flag_is_named():
    with pytest.raises(ServerError, match="http://s:1 returned no routed experts for prompt 0: .*"
                                          "--enable-return-routed-experts"):
        samples_from_outputs([reply([9, 10], None)], 0, 1, 0, "http://s:1", routed_prompt_length=len(PROMPT))


def test_routing_that_does_not_fit_the_tokens_is_refused():
    routing = torch.zeros(4, LAYERS, TOPK, dtype=torch.int32)  # 4 tokens' ids for a reply of 6 tokens (5 routed)
    with pytest.raises(RolloutError, match="24 routed expert ids for p do not split over 5 tokens × top-2"):
        routed_experts_from_meta({"routed_experts": sglang_encoded(routing)}, tokens=6, topk=TOPK, server="s",
                                 what="p")


MOE = ["model.source=tiny", "model.tiny.arch=qwen3_moe", "data.source=synthetic",
       "algorithm.moe_routing_replay=replay_rollout", "rollout.engine=sglang"]


def test_r3_on_sglang_needs_the_flag_in_the_config_and_cuda_servers():
    with pytest.raises(ConfigError, match="add --enable-return-routed-experts to rollout.sglang.extra_server_args"):
        load_config(None, MOE)
    flagged = load_config(None, MOE + ["rollout.sglang.extra_server_args=[--enable-return-routed-experts]"])
    backend = select_backend()
    assert backend.device_type == "cpu"
    with pytest.raises(ConfigError, match="SGLang 0.5.23's CPU server cannot capture routing"):
        check_rollout_routing(flagged, backend)
    check_rollout_routing(load_config(None, MOE[:-1] + ["rollout.engine=embedded"]), backend)  # control
