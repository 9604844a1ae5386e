"""The exporter at TP=2/PP=2 yields exactly the HF state dict the weights came from (bit-exact), every name once.

One set of 4 spawned gloo ranks, two models (Qwen2 untied with vocab 101, Llama with tied embeddings):
* :func:`export_hf_buckets` — per-stage buckets on the stage sources, each within ``bucket_bytes`` unless it is a
  single larger tensor, together every HF name exactly once;
* :func:`gather_hf_buckets_to_rank0` with a bf16 cast — everything on global rank 0 through the packed p2p path;
* rank 0 writing the gathered buckets with :func:`dapo_megatron.hf_format.write_hf_folder` (one shard per bucket)
  — sharded safetensors + index that ``transformers`` loads back bit-exact and that our loader loads back into the
  megatron model bit-exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from spawn_ranks import run_distributed
from tiny_models import save_random_hf_model, tiny_hf_config

BUCKET_BYTES = 16 * 1024  # between the sizes of the tiny model's tensors (norms 192 B ... embedding 19 KB)


def _export_job(model_dirs: dict, out_root: str, bucket_bytes: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dapo_megatron.handoff import export_hf_buckets, gather_hf_buckets_to_rank0
    from dapo_megatron.hf_format import write_hf_folder
    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec, unwrap_model
    from dapo_megatron.policy.model import build_model, transformer_config

    backend = init_distributed(2, 2).backend
    results = {}
    for name, model_dir in model_dirs.items():
        seed_everything(0)
        spec = load_model_spec(model_dir)
        tconfig = transformer_config(spec, backend, tensor_parallel=2, pipeline_parallel=2)
        model = build_model(spec, tconfig, backend)
        load_hf_weights(model, spec, model_dir)

        stage_buckets = [[(n, t.clone()) for n, t in bucket]
                         for bucket in export_hf_buckets(model, spec, bucket_bytes=bucket_bytes)]
        on_rank0 = {}
        for bucket in gather_hf_buckets_to_rank0(model, spec, bucket_bytes=bucket_bytes, dtype=torch.bfloat16):
            for n, t in bucket:
                assert n not in on_rank0, f"{n} received twice"
                on_rank0[n] = t.clone()
        out_dir = Path(out_root) / name
        buckets = gather_hf_buckets_to_rank0(model, spec, bucket_bytes=bucket_bytes)
        if dist.get_rank() == 0:
            write_hf_folder(out_dir, buckets, side_files_from=model_dir)
        else:
            for _ in buckets:  # the TP gathers and the sends to rank 0
                pass
        dist.barrier()

        reloaded = build_model(spec, tconfig, backend)  # the exported folder loads back into the same layout, bit-exact
        load_hf_weights(reloaded, spec, out_dir)
        original = dict(unwrap_model(model).named_parameters())
        reload_equal = all(torch.equal(p, original[n]) for n, p in unwrap_model(reloaded).named_parameters())
        results[name] = dict(stage_buckets=stage_buckets, on_rank0=on_rank0, reload_equal=reload_equal,
                             pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                             tp_rank=parallel_state.get_tensor_model_parallel_rank())
    return results


CASES = {
    "qwen2_untied_v101": lambda: tiny_hf_config("qwen2", vocab_size=101),
    "llama_tied_v101": lambda: tiny_hf_config("llama", vocab_size=101, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    references, model_dirs = {}, {}
    for i, (name, make_config) in enumerate(CASES.items()):
        model = save_random_hf_model(root / "hf" / name, make_config(), seed=20 + i)
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight")  # tied: not a separate tensor (save_pretrained drops it too)
        references[name] = state
        model_dirs[name] = str(root / "hf" / name)
    results = run_distributed(_export_job, 4, model_dirs, str(root / "out"), BUCKET_BYTES, timeout_s=600)
    return references, results, root / "out"


@pytest.mark.parametrize("name", list(CASES))
def test_stage_buckets_are_the_hf_state_dict_bit_exact(exported, name):
    references, results, _ = exported
    reference = references[name]
    seen: dict[str, torch.Tensor] = {}
    for rank_result in results:
        r = rank_result[name]
        if r["tp_rank"] != 0:
            assert r["stage_buckets"] == [], "only TP rank 0 of each stage yields buckets"
            continue
        for bucket in r["stage_buckets"]:
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            assert size <= BUCKET_BYTES or len(bucket) == 1, f"bucket of {size} B with {len(bucket)} tensors"
            for n, t in bucket:
                assert n not in seen, f"{n} exported twice"
                seen[n] = t
    assert set(seen) == set(reference)
    for n, t in reference.items():
        assert seen[n].dtype == t.dtype and torch.equal(seen[n], t), n
    sizes = [len(b) for r in results for b in r[name]["stage_buckets"]]
    assert max(sizes) > 1 and min(sizes) == 1  # both bundling and single oversized tensors were exercised


@pytest.mark.parametrize("name", list(CASES))
def test_gather_to_rank0_delivers_every_stage_bf16(exported, name):
    references, results, _ = exported
    on_rank0 = results[0][name]["on_rank0"]
    assert all(not r[name]["on_rank0"] for r in results[1:])
    assert set(on_rank0) == set(references[name])
    for n, t in references[name].items():
        assert on_rank0[n].dtype == torch.bfloat16 and torch.equal(on_rank0[n], t.to(torch.bfloat16)), n


@pytest.mark.parametrize("name", list(CASES))
def test_exported_dir_loads_in_transformers_and_back_into_megatron(exported, name):
    from safetensors.torch import load_file

    references, results, out_root = exported
    out_dir = out_root / name
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not list(out_root.glob(".*tmp*"))  # sharded; no temporary folder left behind
    on_disk = {}
    for f in files:
        on_disk.update(load_file(out_dir / f))
    assert set(on_disk) == set(references[name]) == set(index["weight_map"])
    assert all(torch.equal(on_disk[n], t) for n, t in references[name].items())
    assert all(r[name]["reload_equal"] for r in results)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    for n, t in model.state_dict().items():
        if n in references[name]:
            assert torch.equal(t, references[name][n]), n
