"""The GPU check's SGLang row (:mod:`gpu_check` runs it; rows: :mod:`gpu_check_setup`): issue 40, items 1, 5 and 6
against a real SGLang server on this GPU. It needs SGLang installed next to CUDA (the lent H200 has neither SGLang
nor the network to install it: there the row says it was skipped and why, and counts as no failure).

:func:`sglang_row` launches one server (TP 1, ``--enable-return-routed-experts``) on a tiny Qwen3-MoE folder made
here, with the ``tensor`` transport, as the trainer does (``build_rollout_engine``), then:

* R3 end to end (item 1): samples generated with routing, through the rollout batch's pack and unpack, laid out for
  the trainer (``routing_layout``): every sample's routing is ``[prompt + response − 1, layers, top-k]``;
* samples in flight (item 6): 4 × the server's running-request limit of one-sample requests streamed at once (a
  multi-turn turn's shape): the most in flight at once is the limit (``engine.in_flight.peak``), not limit / n;
* by-value entries (item 5): the trainer's weights pushed over the tensor transport from this GPU; the payload entries
  that went by value rather than as CUDA IPC handles (0: the only server rank sits on the bucket's GPU). The copy on
  every GPU of a node (``handoff/gpu_copies.py``) needs a node of GPUs and torchrun: not measured here.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from pathlib import Path

import torch
from gpu_check_setup import CheckShapes, Row

ROW = "SGLang on this GPU: R3 routing, samples in flight, by-value entries"


def sglang_unavailable() -> str | None:
    """Why the row cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA (SGLang 0.5.23's CPU server cannot return routed experts)"
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed in this Python"
    return None


def _config(model_dir: Path, run_dir: Path):
    from dapo_megatron.config import load_config

    return load_config(None, [
        "model.source=tiny", "model.tiny.arch=qwen3_moe", "data.source=synthetic", "rollout.engine=sglang",
        "rollout.n_samples=4", "rollout.sglang.transport=tensor", "rollout.sglang.num_servers=1",
        "rollout.sglang.mem_fraction_static=0.3", "algorithm.moe_routing_replay=replay_rollout",
        "rollout.sglang.extra_server_args=[--enable-return-routed-experts]", "warm_start.enabled=false",
        f"trainer.run_dir={run_dir}"])


def _r3_samples(engine, config) -> int:
    """Samples generated with routing, through the batch's pack/unpack, laid out for the trainer; returns how many."""
    from dapo_megatron.collectors.batch import pack_rollout_batch, unpack_rollout_batch
    from dapo_megatron.collectors.group import RolloutGroup
    from dapo_megatron.policy.rollout_routing import routing_layout
    from dapo_megatron.rollout import SamplingParams

    engine.return_routed_experts = True
    prompts = [[5, 6, 7, 8], [11, 3, 9], [20, 21, 22, 23, 24], [40, 41]]
    generated = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=16))
    groups = [RolloutGroup(prompt_ids=p, ground_truth="1", data_source="t", weight_version=0,
                           responses=[s.token_ids for s in samples], engine_logprobs=[s.logprobs for s in samples],
                           finish_reasons=[s.finish_reason for s in samples], accs=[True, False], scores=[1.0, -1.0],
                           overlong_penalties=[0.0, 0.0], routed_experts=[s.routed_experts for s in samples])
              for p, samples in zip(prompts, generated)]
    unpacked, _ = unpack_rollout_batch(pack_rollout_batch(groups, {}))
    tiny = config.model.tiny
    laid_out = [routing_layout(g.routed_experts[i], prompt_length=len(g.prompt_ids),
                               response_length=len(g.responses[i]), layers=tiny.num_layers,
                               topk=tiny.num_experts_per_tok, where=f"response {i} of {g.prompt_ids}")
                for g in unpacked for i in range(len(g.responses))]
    return sum(r is not None for r in laid_out)


def _peak_in_flight(engine) -> tuple[int, int]:
    """(the most samples in flight at once, the engine's limit) over 4 × limit one-sample streamed requests."""
    from dapo_megatron.rollout import GenerationRequest, SamplingParams

    limit = engine.in_flight.limit
    requests = [GenerationRequest(f"turn{i}", (5, 6, 7, 8 + i % 50), SamplingParams(n=1, max_new_tokens=32))
                for i in range(4 * limit)]
    engine.submit(requests)
    finished, deadline = 0, time.monotonic() + 600
    while finished < len(requests) and time.monotonic() < deadline:
        finished += len(engine.poll(timeout_s=1.0))
    return engine.in_flight.peak, limit


def _by_value_entries(engine, actor, spec) -> int:
    """Push the actor's weights over the tensor transport; the payload entries that went by value."""
    from dapo_megatron.handoff import gather_hf_buckets_to_rank0
    from dapo_megatron.rollout.sglang.engine import server_targets
    from dapo_megatron.rollout.sglang.tensor_payloads import bucket_gpu, by_value_entries

    targets = server_targets(engine.pool.available())
    counted = []

    def counting(buckets):
        for bucket in buckets:
            counted.append(by_value_entries(targets, bucket_gpu(bucket), getattr(bucket, "copies", {})))
            yield bucket

    engine.update_weights(counting(gather_hf_buckets_to_rank0(actor.model, spec, dtype=torch.bfloat16)), version=1)
    return max(counted, default=-1)


def sglang_row(shapes: CheckShapes, device: torch.device) -> Row:
    reason = sglang_unavailable()
    if reason is not None:
        return Row(ROW, "skipped", reason, {"ran": 0.0})
    from dapo_megatron.backend_registry import select_backend
    from dapo_megatron.config import ModelConfig, OptimConfig, ParallelConfig
    from dapo_megatron.policy.actor import build_actor
    from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec
    from dapo_megatron.rollout.factory import build_rollout_engine
    from dapo_megatron.tiny_model.build import prepare_tiny_model

    with tempfile.TemporaryDirectory(prefix="gpu_check_sglang_") as tmp:
        config = _config(Path(tmp) / "hf", Path(tmp) / "run")
        model_dir = prepare_tiny_model(config, Path(tmp) / "hf")
        spec = load_model_spec(model_dir)
        actor = build_actor(spec, backend=select_backend("auto"), model=ModelConfig(precision="bf16"),
                            parallel=ParallelConfig(), optim=OptimConfig(), routing_replay=True,
                            micro_batch_tokens=shapes.token_budget, temperature=1.0)
        load_hf_weights(actor.model, spec, model_dir)
        engine = build_rollout_engine(config, model_dir, Path(tmp) / "run", select_backend("auto"))
        try:
            routed = _r3_samples(engine, config)
            peak, limit = _peak_in_flight(engine)
            by_value = _by_value_entries(engine, actor, spec)
        finally:
            engine.shutdown()
    ok = routed == 8 and peak == limit and by_value == 0
    return Row(ROW, "ok" if ok else "FAILED",
               f"R3: {routed}/8 samples' routing read, packed, unpacked and laid out; samples in flight at once "
               f"{peak} of the server's {limit} (one-sample requests); by-value payload entries per bucket {by_value}",
               {"ran": 1.0, "routed_samples": float(routed), "peak_in_flight": float(peak),
                "in_flight_limit": float(limit), "by_value_entries": float(by_value)})
