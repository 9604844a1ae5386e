"""The GPU check's routing-replay row (:mod:`gpu_check` runs it; rows: :mod:`gpu_check_setup`): issue 40, items 3, 4
and 7 on one GPU, without SGLang.

:func:`replay_recompute_row` — a small Qwen3-MoE actor with routing replay, the update replaying π_old's recorded
routing over several micro-batches, once without and once with full activation recomputation (``model.recompute:
full``, the layout the docs show fitting Qwen3-30B-A3B):

* the two updates agree (loss, gradient norm) and the replayed one's importance ratio is exactly 1;
* the bytes megatron's REPLAY_BACKWARD queue holds on the device after each router forward, the most over the pass:
  0 without recomputation (it held every micro-batch's targets to the end of the pass), one micro-batch's at most
  with it; next to ``plan``'s count of the targets (``StageMemory.routing_bytes``);
* host syncs the replay's own code causes per micro-batch (CUDA's sync debug mode, warnings raised from
  ``policy/moe_routing.py`` or ``policy/rollout_routing.py``) during an R3-style replayed forward: 0 expected.

``--tiny`` on CPU forces recomputation on the CPU backend (which never chooses it) so the row computes the same.
"""

from __future__ import annotations

import math
import warnings

import torch
from gpu_check_colocated import moe_spec
from gpu_check_setup import CheckShapes, Row, dapo_loss, random_samples

REPLAY_FILES = ("moe_routing.py", "rollout_routing.py")


def _recomputing(backend, recompute: str):
    """``backend`` building with ``recompute`` (the CPU backend chooses none; on CUDA the backend keeps the request)."""
    class Recomputing(type(backend)):
        def recompute(self, requested):
            return recompute

    return Recomputing()


def _actor(spec, shapes: CheckShapes, recompute: str):
    from dapo_megatron.backend_registry import select_backend
    from dapo_megatron.config import ModelConfig, OptimConfig, ParallelConfig
    from dapo_megatron.policy.actor import build_actor

    return build_actor(spec, backend=_recomputing(select_backend("auto"), recompute),
                       model=ModelConfig(precision="bf16", recompute=recompute),
                       parallel=ParallelConfig(use_distributed_optimizer=False),
                       optim=OptimConfig(lr=1e-4, warmup_steps=0), routing_replay=True,
                       micro_batch_tokens=shapes.token_budget, temperature=1.0)


def _queued_bytes(actor) -> list[int]:
    """After every router forward: the bytes of targets megatron's REPLAY_BACKWARD queues hold, over the stage."""
    from dapo_megatron.policy.moe_routing import moe_routers

    routers, seen = moe_routers(actor.model), []

    def hook(module, args, output) -> None:
        seen.append(sum(t.numel() * t.element_size() for r in routers for t in r.router_replay.replay_backward_list))

    for router in routers:
        router.register_forward_hook(hook)
    return seen


def _replay_syncs(actor, samples, batching) -> int:
    """Host syncs raised from the replay's own files during an R3 forward (every position left to the routers)."""
    if not torch.cuda.is_available():
        return 0
    engine = [None] * len(samples)  # the routers' own choices where the engine gave none: the layout still runs
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            actor.compute_logprobs(samples, batching=batching, engine_routing=engine)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum(str(w.filename).endswith(REPLAY_FILES) for w in caught)


def replay_recompute_row(shapes: CheckShapes, device: torch.device) -> Row:
    from dapo_megatron.policy.batch_plan import PackedBatching
    from dapo_megatron.policy.memory.gpu import estimate_memory
    from dapo_megatron.policy.packing import PolicySample

    spec = moe_spec(shapes)
    samples = random_samples(shapes.samples, spec.vocab_size, shapes.prompt_tokens, shapes.response_tokens, seed=5)
    batching = PackedBatching(token_budget=max(s.length for s in samples) + 8)  # several micro-batches
    results = {}
    for recompute in ("none", "full"):
        torch.manual_seed(0)
        actor = _actor(spec, shapes, recompute)
        old = actor.compute_logprobs(samples, record_routing=True, batching=batching)
        queued = _queued_bytes(actor)
        update = actor.train_minibatch([PolicySample(s.prompt_ids, s.response_ids, s.advantage, old_logprobs=lp)
                                        for s, lp in zip(samples, old.logprobs)], dapo_loss(), batching=batching,
                                       routing=old.routing)
        syncs = _replay_syncs(actor, samples, batching) if recompute == "none" else 0
        results[recompute] = dict(update=update, queued=max(queued, default=0), forwards=len(queued), syncs=syncs,
                                  micro_batches=len(old.routing.per_router[0]))
        del actor
    plain, full = results["none"], results["full"]
    (stage,) = estimate_memory(spec, tensor_parallel=1, pipeline_parallel=1, data_parallel=1,
                               micro_batch_tokens=batching.token_budget, recompute="full", routing_replay=True)
    same = (math.isclose(plain["update"]["pg_loss"], full["update"]["pg_loss"], rel_tol=1e-2, abs_tol=1e-3)
            and math.isclose(plain["update"]["grad_norm"], full["update"]["grad_norm"], rel_tol=5e-2))
    ok = (same and full["update"]["ratio_mean"] == 1.0 and plain["queued"] == 0
          and full["queued"] <= stage.routing_bytes and plain["syncs"] == 0 and full["forwards"] > plain["forwards"])
    return Row("routing replay with full recomputation", "ok" if ok else "FAILED",
               f"{plain['micro_batches']} micro-batches; update loss {plain['update']['pg_loss']:.4g} vs "
               f"{full['update']['pg_loss']:.4g} recomputed, grad norm {plain['update']['grad_norm']:.4g} vs "
               f"{full['update']['grad_norm']:.4g}, ratio {full['update']['ratio_mean']:g}; REPLAY_BACKWARD queue at "
               f"most {plain['queued']} B without recomputation, {full['queued']} B with it (plan: "
               f"{stage.routing_bytes} B of targets); host syncs in the replay's code {plain['syncs']}",
               {"loss_plain": plain["update"]["pg_loss"], "loss_recomputed": full["update"]["pg_loss"],
                "queued_bytes_plain": float(plain["queued"]), "queued_bytes_recomputed": float(full["queued"]),
                "planned_target_bytes": float(stage.routing_bytes), "replay_syncs": float(plain["syncs"]),
                "router_forwards_recomputed": float(full["forwards"])})
