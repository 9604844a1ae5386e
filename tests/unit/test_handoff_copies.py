"""How the exporter moves bytes. At TP=2 on CPU, the CPU backend's same-host gather through shared memory
(cpu/shm_gather.py):
the exported tensors are bit-identical to the gloo gather's, a later export sees the weights as they are then (the
mapping is reused, never stale), and no file is left in /dev/shm; the export on every rank (a copy of each bucket
on every GPU, handoff/gpu_copies.py) makes the same buckets on each rank. At TP=1: a parameter that is an HF tensor
as it is goes out without a copy, every other tensor as a compact copy of its own elements."""

from __future__ import annotations

import os

import torch
from spawn_ranks import run_distributed
from tiny_models import save_random_hf_model, tiny_hf_config


def _policy_model(model_dir: str, tensor_parallel: int):
    """This rank's megatron model of the HF folder at TP=``tensor_parallel`` (PP=1), and its spec."""
    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec
    from dapo_megatron.policy.model import build_model, transformer_config

    backend = init_distributed(tensor_parallel, 1).backend
    seed_everything(0)
    spec = load_model_spec(model_dir)
    model = build_model(spec, transformer_config(spec, backend, tensor_parallel=tensor_parallel, pipeline_parallel=1),
                        backend)
    load_hf_weights(model, spec, model_dir)
    return model, spec, backend


def _exports_job(model_dir: str) -> dict:
    import torch.distributed as dist

    from dapo_megatron.cpu.shm_gather import SHM_DIR, SharedMemoryGather
    from dapo_megatron.handoff import gather_hf_buckets_to_rank0
    from dapo_megatron.handoff.tp_gather import ProcessGroupGather

    model, spec, backend = _policy_model(model_dir, 2)
    shared_memory = backend.tp_gather
    assert isinstance(shared_memory, SharedMemoryGather)  # the CPU backend's gather

    def export(tp_gather) -> dict:
        return {name: tensor.clone()
                for bucket in gather_hf_buckets_to_rank0(model, spec, bucket_bytes=4096, tp_gather=tp_gather)
                for name, tensor in bucket}

    over_gloo = export(ProcessGroupGather())
    mapped_without = shared_memory.mapped_regions
    first = export(shared_memory)
    mapped_with = shared_memory.mapped_regions
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(2.0)
    second = export(shared_memory)
    dist.barrier()
    leftovers = [name for name in os.listdir(SHM_DIR) if name.startswith("dapo_megatron_handoff_")]
    return dict(rank=dist.get_rank(), over_gloo=over_gloo, first=first, second=second, mapped_without=mapped_without,
                mapped_with=mapped_with, leftovers=leftovers, copies=_copies_on_every_rank(model, spec))


def _copies_on_every_rank(model, spec) -> dict:
    """Issue 40.5's handoff: every rank exports the same buckets itself and rank 0's stream carries the other ranks'
    serialized copies (on CPU a pickle of the copy stands in for CUDA IPC handles, which need a GPU)."""
    import pickle

    import torch.distributed as dist

    from dapo_megatron.handoff import export_hf_buckets
    from dapo_megatron.handoff.gpu_copies import GpuCopies, buckets_with_copies

    rank, collected = dist.get_rank(), []
    copies = GpuCopies(serialize=None if rank == 0 else lambda bucket: pickle.dumps((rank, bucket)), window=2,
                       collect=lambda: collected.append(len(collected)))
    own = [[(n, t.clone()) for n, t in bucket] for bucket in export_hf_buckets(model, spec, bucket_bytes=4096,
                                                                              every_rank=True)]
    received = [(bucket, {gpu: pickle.loads(serialized) for gpu, serialized in bucket.copies.items()})
                for bucket in buckets_with_copies(export_hf_buckets(model, spec, bucket_bytes=4096, every_rank=True),
                                                  copies)]
    return dict(own=own, received=received, collected=len(collected))


def test_shared_memory_gather_equals_the_gloo_gather(tmp_path):
    model_dir = tmp_path / "hf"
    save_random_hf_model(model_dir, tiny_hf_config("qwen2"), seed=0)
    rank0, rank1 = run_distributed(_exports_job, 2, str(model_dir))
    assert rank1["first"] == {} and rank1["over_gloo"] == {}  # rank 0 receives everything
    # the shared-memory path ran (control: it had not before)
    assert rank0["mapped_without"] == 0 and rank0["mapped_with"] == 1
    assert rank0["first"].keys() == rank0["over_gloo"].keys()
    for name, tensor in rank0["over_gloo"].items():
        assert torch.equal(rank0["first"][name], tensor), name
        assert torch.equal(rank0["second"][name], tensor * 2.0), f"{name}: a later export read stale shards"
    assert rank0["leftovers"] == [] and rank1["leftovers"] == []
    # every rank made the same buckets as rank 0's gather, on its own; rank 0's stream carried rank 1's copy of each
    on_rank0, on_rank1 = rank0["copies"], rank1["copies"]
    assert [name for bucket in on_rank0["own"] for name, _ in bucket] == list(rank0["over_gloo"])
    assert [[n for n, _ in b] for b in on_rank1["own"]] == [[n for n, _ in b] for b in on_rank0["own"]]
    assert all(torch.equal(t, rank0["second"][n]) for bucket in on_rank1["own"] for n, t in bucket)  # doubled
    assert on_rank1["received"] == [] and len(on_rank0["received"]) == len(on_rank0["own"]) > 2
    for bucket, copies in on_rank0["received"]:
        (maker, copy), = copies.values()  # one copy, made by rank 1
        assert maker == 1 and [n for n, _ in copy] == [n for n, _ in bucket]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(copy, bucket))
    # rank 1 dropped each copy two buckets after rank 0 sent it, and the rest at the end
    assert on_rank1["collected"] == len(on_rank0["own"]) - 2 + 1 and on_rank0["collected"] == 1


def _tp1_job(model_dir: str) -> dict:
    from dapo_megatron.handoff import gather_hf_buckets_to_rank0
    from dapo_megatron.policy.hf_loader import unwrap_model

    model, spec, _ = _policy_model(model_dir, 1)
    parameters = {param.data_ptr() for param in unwrap_model(model).parameters()}
    exported = {}
    for bucket in gather_hf_buckets_to_rank0(model, spec, bucket_bytes=4096):
        for name, tensor in bucket:
            exported[name] = dict(is_parameter=tensor.data_ptr() in parameters, contiguous=tensor.is_contiguous(),
                                  compact=tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(),
                                  value=tensor.clone())
    return exported


def test_tp1_export_copies_only_what_is_not_a_whole_parameter(tmp_path):
    from safetensors.torch import load_file

    model_dir = tmp_path / "hf"
    save_random_hf_model(model_dir, tiny_hf_config("qwen2"), seed=0)  # vocab 101: padded rows in megatron
    exported = run_distributed(_tp1_job, 1, str(model_dir))[0]
    reference = load_file(str(model_dir / "model.safetensors"))
    assert exported.keys() == reference.keys()
    for name, record in exported.items():
        assert torch.equal(record["value"], reference[name]), name
        assert record["contiguous"] and record["compact"], name  # nothing serializes more than its own bytes
    as_is = {name for name, record in exported.items() if record["is_parameter"]}
    assert {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight"} <= as_is
    # interleaved QKV rows, the fc1 halves and the vocabulary without its padding rows are copies
    copied = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.bias",
              "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight",
              "lm_head.weight"}
    assert not copied & as_is
