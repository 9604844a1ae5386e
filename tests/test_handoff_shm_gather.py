"""The exporter's same-host TP gather through shared memory (handoff/shm_gather.py) at TP=2 on CPU: the exported
tensors are bit-identical to the gloo gather's, a later export sees the weights as they are then (the mapping is
reused, never stale), and no file is left in /dev/shm."""

from __future__ import annotations

import os

import torch
from spawn_ranks import run_distributed
from test_policy_model_parity import save_random_hf_model, tiny_config


def _exports_job(model_dir: str) -> dict:
    import torch.distributed as dist

    import dapo_megatron.handoff.exporter as exporter
    from dapo_megatron.handoff import gather_hf_buckets_to_rank0, shm_gather
    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec
    from dapo_megatron.policy.model import build_model, transformer_config

    init_distributed(2, 1)
    seed_everything(0)
    spec = load_model_spec(model_dir)
    model = build_model(spec, transformer_config(spec, tensor_parallel=2, pipeline_parallel=1))
    load_hf_weights(model, spec, model_dir)

    def export() -> dict:
        return {name: tensor.clone() for bucket in gather_hf_buckets_to_rank0(model, spec, bucket_bytes=4096)
                for name, tensor in bucket}

    shared_memory = exporter.shared_memory_gather
    exporter.shared_memory_gather = lambda group, shards: None
    over_gloo = export()
    mapped_without = len(shm_gather._mappings)
    exporter.shared_memory_gather = shared_memory
    first = export()
    mapped_with = len(shm_gather._mappings)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(2.0)
    second = export()
    dist.barrier()
    leftovers = [name for name in os.listdir(shm_gather.SHM_DIR) if name.startswith("dapo_megatron_handoff_")]
    return dict(rank=dist.get_rank(), over_gloo=over_gloo, first=first, second=second, mapped_without=mapped_without,
                mapped_with=mapped_with, leftovers=leftovers)


def test_shared_memory_gather_equals_the_gloo_gather(tmp_path):
    model_dir = tmp_path / "hf"
    save_random_hf_model(model_dir, tiny_config("qwen2"), seed=0)
    rank0, rank1 = run_distributed(_exports_job, 2, str(model_dir))
    assert rank1["first"] == {} and rank1["over_gloo"] == {}  # rank 0 receives everything
    # the shared-memory path ran (control: it had not before)
    assert rank0["mapped_without"] == 0 and rank0["mapped_with"] == 1
    assert rank0["first"].keys() == rank0["over_gloo"].keys()
    for name, tensor in rank0["over_gloo"].items():
        assert torch.equal(rank0["first"][name], tensor), name
        assert torch.equal(rank0["second"][name], tensor * 2.0), f"{name}: a later export read stale shards"
    assert rank0["leftovers"] == [] and rank1["leftovers"] == []
