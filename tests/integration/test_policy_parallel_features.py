"""The paper-scale policy features, run for real on CPU ranks (gloo):

* sequence parallelism at TP=2 (megatron's local spec with the SP-aware norm) gives the log-probs, loss, gradient
  norm and update of SP off — and without the norms' SP mark the update would differ (the control);
* activation recomputation (selective, full) gives the update of none;
* the gradient norm is computed once per update (megatron's own ``step()`` computes it twice: the control) and the
  clipped update equals ``step()``'s;
* ``overlap_grad_reduce`` + ``overlap_param_gather`` at DP=2 give the same updates, log-probs and exported weights as
  no overlap, although right after a step the parameters are stale (the control showing the forced sync matters);
* the weight handoff at PP=2: per-stage broadcast groups {0, source} for the gather route, and the per-stage route
  into an engine that receives one stream per stage (each stage written by its own source), errors on every rank.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from actor_harness import gather_hf_weights, loss_of, random_samples, write_tiny_qwen2
from spawn_ranks import run_distributed

NUM_SAMPLES = 8


def manual_actor(hf_dir, *, tensor_parallel=1, sequence_parallel=False, recompute="none", grad_clip=1e6,
                 distributed_optimizer=False, overlap=False, token_budget=4096):
    """An fp32 actor built like ``build_actor`` but with the switches a CPU run would not take by itself."""
    from megatron.core import parallel_state

    from dapo_megatron.backend_registry import select_backend
    from dapo_megatron.config import OptimConfig
    from dapo_megatron.platform import seed_everything
    from dapo_megatron.policy.actor import Actor
    from dapo_megatron.policy.batch_plan import PackedBatching
    from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec
    from dapo_megatron.policy.model import build_model, transformer_config
    from dapo_megatron.policy.optimizer import wrap_for_training

    seed_everything(0)
    backend = select_backend()  # the CPU backend, whose norms carry the sequence-parallel mark
    spec = load_model_spec(hf_dir)
    tconfig = transformer_config(spec, backend, tensor_parallel=tensor_parallel,
                                 pipeline_parallel=parallel_state.get_pipeline_model_parallel_world_size(),
                                 sequence_parallel=sequence_parallel, recompute=recompute)
    model, optimizer, scheduler = wrap_for_training(
        build_model(spec, tconfig, backend),
        OptimConfig(lr=1e-2, weight_decay=0.1, adam_eps=1e-3, grad_clip=grad_clip, warmup_steps=0),
        use_distributed_optimizer=distributed_optimizer, overlap_grad_reduce=overlap, overlap_param_gather=overlap)
    load_hf_weights(model, spec, hf_dir)
    optimizer.reload_model_params()
    actor = Actor(model, optimizer, scheduler, backend=backend, real_vocab_size=spec.vocab_size,
                  batching=PackedBatching(token_budget=token_budget), temperature=0.9)
    return actor, spec


def samples():
    return random_samples(NUM_SAMPLES, seed=11)


def step_record(actor, spec, updates=1):
    """Log-probs, the metrics of ``updates`` updates, and the HF weights after them (on rank 0)."""
    logprobs = actor.compute_logprobs(samples()).logprobs
    metrics = [actor.train_minibatch(samples(), loss_of()) for _ in range(updates)]
    return dict(logprobs=logprobs, metrics=metrics, weights=gather_hf_weights(actor, spec))


# --------------------------------------------------------------------------------------------- TP=2: SP


def sequence_parallel_job(hf_dir):
    from dapo_megatron.cpu.layers import LocalRMSNorm
    from dapo_megatron.platform import init_distributed

    init_distributed(2, 1)
    results = {}
    for name, sequence_parallel, marked in (("off", False, False), ("on", True, True), ("unmarked", True, False)):
        actor, spec = manual_actor(hf_dir, tensor_parallel=2, sequence_parallel=sequence_parallel, token_budget=40)
        norms = [m for m in actor.model.modules() if isinstance(m, LocalRMSNorm)]
        marked_by_the_spec = sum(norm.weight.sequence_parallel for norm in norms)
        for norm in norms:
            norm.weight.sequence_parallel = marked
        row_lengths = [mb.tokens.shape[1] for mb in actor.plan(samples(), None).micro_batches]
        results[name] = dict(step_record(actor, spec), norms=marked_by_the_spec, row_lengths=row_lengths,
                             sequence_parallel=actor.model.config.sequence_parallel)
    return results


@pytest.mark.slow  # 3 actors on 2 ranks
def test_sequence_parallel_tp2_matches_sp_off(tmp_path):
    hf_dir = str(write_tiny_qwen2(tmp_path / "hf"))
    off, on, unmarked = (run_distributed(sequence_parallel_job, 2, hf_dir)[0][k] for k in ("off", "on", "unmarked"))
    assert not off["sequence_parallel"] and on["sequence_parallel"]
    assert off["norms"] == 0 and on["norms"] == 2 * 4 + 1  # two per layer + the final norm, all SP-aware
    assert all(length % 2 == 0 for length in on["row_lengths"]) and len(on["row_lengths"]) > 1
    for got, want in zip(on["logprobs"], off["logprobs"]):
        np.testing.assert_allclose(got, want, atol=1e-5)
    for key in ("pg_loss", "grad_norm"):
        assert on["metrics"][0][key] == pytest.approx(off["metrics"][0][key], rel=1e-5)
    for name, tensor in off["weights"].items():
        np.testing.assert_allclose(on["weights"][name], tensor, atol=1e-6, err_msg=name)
    # Control: without the SP mark the norms' gradients are not summed over TP and their update differs.
    norm_names = [n for n in off["weights"] if "norm" in n]
    assert any(not torch.allclose(unmarked["weights"][n], off["weights"][n], atol=1e-6) for n in norm_names)


# ------------------------------------------------------------------ world 1: recompute, grad norm once


def world_one_job(hf_dir):
    import megatron.core.optimizer.optimizer as megatron_optimizer

    import dapo_megatron.policy.actor as actor_module
    from dapo_megatron.platform import init_distributed

    init_distributed(1, 1)
    results = {"recompute": {}, "norm": {}}
    for mode in ("none", "selective", "full"):
        actor, spec = manual_actor(hf_dir, recompute=mode, token_budget=40)
        results["recompute"][mode] = dict(step_record(actor, spec),
                                           granularity=actor.model.config.recompute_granularity)

    counted = {"norm": 0}
    real_norm = megatron_optimizer.get_grad_norm_fp32

    def counting_norm(*args, **kwargs):
        counted["norm"] += 1
        return real_norm(*args, **kwargs)

    megatron_optimizer.get_grad_norm_fp32 = counting_norm
    real_clip_and_step = actor_module.clip_and_step
    for optimizer_kind in ("plain", "distributed"):
        for path in ("once", "megatron_step"):
            actor_module.clip_and_step = (real_clip_and_step if path == "once"
                                          else lambda optimizer, grad_norm: optimizer.step()[0])
            actor, spec = manual_actor(hf_dir, grad_clip=0.05, distributed_optimizer=optimizer_kind == "distributed")
            counted["norm"] = 0
            metrics = actor.train_minibatch(samples(), loss_of())
            results["norm"][optimizer_kind, path] = dict(norm_calls=counted["norm"], metrics=metrics,
                                                          weights=gather_hf_weights(actor, spec))
    actor_module.clip_and_step = real_clip_and_step
    megatron_optimizer.get_grad_norm_fp32 = real_norm
    return results


@pytest.fixture(scope="module")
def world_one(tmp_path_factory):
    hf_dir = str(write_tiny_qwen2(tmp_path_factory.mktemp("features") / "hf"))
    return run_distributed(world_one_job, 1, hf_dir)[0]


@pytest.mark.slow  # 7 actors
def test_recomputation_gives_the_same_update(world_one):
    runs = world_one["recompute"]
    assert [runs[m]["granularity"] for m in ("none", "selective", "full")] == [None, "selective", "full"]
    for mode in ("selective", "full"):
        assert runs[mode]["metrics"][0]["grad_norm"] == pytest.approx(runs["none"]["metrics"][0]["grad_norm"],
                                                                      rel=1e-6)
        for name, tensor in runs["none"]["weights"].items():
            np.testing.assert_allclose(runs[mode]["weights"][name], tensor, atol=1e-6, err_msg=f"{mode}: {name}")


@pytest.mark.slow
def test_gradient_norm_is_computed_once_and_the_clipped_update_equals_megatron_step(world_one):
    runs = world_one["norm"]
    for kind in ("plain", "distributed"):
        once, control = runs[kind, "once"], runs[kind, "megatron_step"]
        assert once["norm_calls"] == 1, kind
        assert control["norm_calls"] == 2, kind  # the control: megatron's step() computes it again
        grad_norm = once["metrics"]["grad_norm"]
        assert math.isfinite(grad_norm) and grad_norm > 0.05 * 10  # clip_grad 0.05: the update is clipped
        assert grad_norm == control["metrics"]["grad_norm"]
        for name, tensor in control["weights"].items():
            np.testing.assert_allclose(once["weights"][name], tensor, atol=1e-7, err_msg=f"{kind}: {name}")


# ------------------------------------------------------------------------------- DP=2: overlap


def overlap_job(hf_dir):
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.policy.hf_loader import unwrap_model

    init_distributed(1, 1)
    results = {}
    for name, overlap in (("off", False), ("on", True)):
        actor, spec = manual_actor(hf_dir, distributed_optimizer=True, overlap=overlap, token_budget=40)
        config = actor.model.ddp_config
        first = actor.train_minibatch(samples(), loss_of())
        right_after_step = [p.detach().clone() for p in unwrap_model(actor.model).parameters()]
        record = step_record(actor, spec, updates=2)  # log-probs first: they must see the first update
        results[name] = dict(record, first=first, right_after_step=right_after_step,
                             overlap=(config.overlap_grad_reduce, config.overlap_param_gather),
                             no_sync=actor.model.config.no_sync_func is not None)
    return results


@pytest.mark.slow  # 2 actors on 2 ranks
def test_overlap_options_give_the_same_training(tmp_path):
    hf_dir = str(write_tiny_qwen2(tmp_path / "hf"))
    ranks = run_distributed(overlap_job, 2, hf_dir)
    off, on = ranks[0]["off"], ranks[0]["on"]
    assert on["overlap"] == (True, True) and on["no_sync"] and off["overlap"] == (False, False)
    assert on["first"]["num_micro_batches"] > 1  # the no-sync path of all but the last micro-batch ran
    for key in ("pg_loss", "grad_norm"):
        assert on["first"][key] == pytest.approx(off["first"][key], rel=1e-6)
    for got, want in zip(on["logprobs"], off["logprobs"]):
        np.testing.assert_allclose(got, want, atol=1e-6)
    for name, tensor in off["weights"].items():
        np.testing.assert_allclose(on["weights"][name], tensor, atol=1e-6, err_msg=name)
    # Control: right after the step the overlapped parameters are stale on each rank (half of them, the other
    # rank's shard), which is why log-probs and the handoff force the parameter sync first.
    for rank in ranks:
        stale = [not torch.equal(a, b) for a, b in zip(rank["on"]["right_after_step"], rank["off"]["right_after_step"])]
        assert any(stale)


# --------------------------------------------------------------------------- PP=2: the handoff routes


class StageFileReceiver:
    """A per-stage receiver (picklable: it travels from rank 0 to the stage sources): each stage's source writes its
    buckets to a file of its own; ``failing_stage`` drops its connection instead."""

    def __init__(self, directory: str, failing_stage: int | None = None):
        self.directory, self.failing_stage = directory, failing_stage

    def open_stage(self, stage, num_stages):
        import torch.distributed as dist

        def consume(buckets):
            tensors = {}
            for bucket in buckets:
                if stage == self.failing_stage:
                    raise ConnectionError(f"stage {stage} lost its connection")
                tensors.update({name: t.clone() for name, t in bucket})
            torch.save({"rank": dist.get_rank(), "tensors": tensors}, Path(self.directory) / f"stage{stage}.pt")
        return consume


def _stagewise_engine(hf_config, directory: str, failing_stage: int | None = None):
    """The embedded engine, receiving one stream per stage through :class:`StageFileReceiver`; the commit loads the
    stage files into its weights."""
    from dapo_megatron.rollout.embedded.engine import EmbeddedEngine

    class StagewiseEngine(EmbeddedEngine):
        writers: list[int] = []

        def stage_stream_receiver(self):
            return StageFileReceiver(directory, failing_stage)

        def commit_stage_streams(self, version):
            files = sorted(Path(directory).glob("stage*.pt"))
            self.writers = [torch.load(f)["rank"] for f in files]
            self.update_weights([list(torch.load(f)["tensors"].items()) for f in files], version)

    return StagewiseEngine(hf_config)


def routes_job(hf_dir, out_dir):
    import torch.distributed as dist

    from dapo_megatron.handoff.stage_routes import stage_broadcast_groups
    from dapo_megatron.hf_format import load_hf_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
    from dapo_megatron.trainer.weight_sync import StageStreamError, sync_engine_weights

    init_distributed(1, 2)
    actor, spec = manual_actor(hf_dir)
    groups = stage_broadcast_groups()
    result = dict(sources=groups.sources, group_ranks=dist.get_process_group_ranks(groups.group(1)),
                  same_groups=stage_broadcast_groups() is groups)
    hf_config = load_hf_config(hf_dir)
    gathered = EmbeddedEngine(hf_config) if dist.get_rank() == 0 else None
    sync_engine_weights(actor.model, spec, gathered, version=1, bucket_bytes=4096, tp_gather=actor.backend.tp_gather)
    per_stage_dir = Path(out_dir) / "per_stage"
    per_stage_dir.mkdir(exist_ok=True)
    stagewise = _stagewise_engine(hf_config, str(per_stage_dir)) if dist.get_rank() == 0 else None
    sync_engine_weights(actor.model, spec, stagewise, version=2, bucket_bytes=4096, tp_gather=actor.backend.tp_gather)
    failing = _stagewise_engine(hf_config, str(Path(out_dir)), failing_stage=1) if dist.get_rank() == 0 else None
    try:
        sync_engine_weights(actor.model, spec, failing, version=3, bucket_bytes=4096,
                            tp_gather=actor.backend.tp_gather)
        result["error"] = None
    except StageStreamError as exc:
        result["error"] = str(exc)
    if dist.get_rank() == 0:
        result["gathered"] = {n: p.detach().clone() for n, p in gathered.model.named_parameters()}
        result["stagewise"] = {n: p.detach().clone() for n, p in stagewise.model.named_parameters()}
        result["versions"] = (gathered.weight_version, stagewise.weight_version)
        result["writers"] = stagewise.writers
    return result


@pytest.mark.slow  # 2 ranks, 3 handoffs
def test_handoff_routes_at_pp2(tmp_path):
    from safetensors.torch import load_file

    hf_dir = write_tiny_qwen2(tmp_path / "hf")
    ranks = run_distributed(routes_job, 2, str(hf_dir), str(tmp_path))
    rank0 = ranks[0]
    assert rank0["sources"] == (0, 1) and rank0["group_ranks"] == [0, 1] and rank0["same_groups"]
    assert rank0["versions"] == (1, 2)
    assert rank0["writers"] == [0, 1]  # each stage's file was written by that stage's own source
    reference = load_file(hf_dir / "model.safetensors")
    for route in ("gathered", "stagewise"):
        for name, tensor in reference.items():
            assert torch.equal(rank0[route][name], tensor), f"{route}: {name}"
    for rank in ranks:  # the failing stage's error reaches every rank
        assert rank["error"] and "stage 1 (rank 1): ConnectionError: stage 1 lost its connection" in rank["error"]
