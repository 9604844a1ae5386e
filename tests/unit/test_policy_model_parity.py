"""Logit parity of our megatron GPTModel (built + loaded from HF safetensors) against HF ``transformers``, fp32.

One set of 4 spawned gloo ranks runs every layout in turn — TP×PP ∈ {1×1, 2×1, 1×2, 2×2} (megatron's
parallel_state is rebuilt between layouts; ranks not needed by a layout are extra data-parallel replicas) — and
every case at each layout: Qwen2 (QKV bias, untied, vocab 101 — not divisible by TP), Llama (tied embeddings),
3 query heads per KV group; at TP=1 also a single KV head and llama3 RoPE scaling. The forward goes through
megatron's own pipeline schedule. The loader's error paths (missing tensor, wrong shape) run in the same processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from logit_parity import TOLERANCE, megatron_logits
from spawn_ranks import run_distributed
from tiny_models import save_random_hf_model, tiny_hf_config

from dapo_megatron.backend_registry import select_backend
from dapo_megatron.policy.model import transformer_config
from dapo_megatron.policy.model_spec import ParallelLayoutError, UnsupportedModelError, model_spec_from_hf

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
SEQ_LEN = 12


def _configs():
    llama3 = tiny_hf_config("llama", num_kv_heads=2)
    llama3.max_position_embeddings = 16384  # transformers wants it above original_max_position_embeddings
    llama3.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return {
        "qwen2_untied_v101": (tiny_hf_config("qwen2", vocab_size=101, tie_word_embeddings=False), None),
        "llama_tied_v101": (tiny_hf_config("llama", vocab_size=101, tie_word_embeddings=True), None),
        "qwen2_one_kv_head": (tiny_hf_config("qwen2", num_kv_heads=1), 1),  # only TP=1 can split it
        "llama3_rope_scaling": (llama3, 1),
    }


def _parity_job(cases: dict, layouts: list, tokens: torch.Tensor, broken_dirs: dict) -> dict:
    from megatron.core import parallel_state

    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.policy.hf_loader import HFCheckpointError, load_hf_weights, load_model_spec
    from dapo_megatron.policy.model import build_model, transformer_config

    out: dict = {"diffs": {}, "errors": {}, "read_fraction": {}}
    for tp, pp in layouts:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        backend = init_distributed(tp, pp).backend
        seed_everything(0)
        reporter = (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
                    and parallel_state.get_data_parallel_rank() == 0)
        for name, (model_dir, reference, max_tp) in cases.items():
            if max_tp is not None and tp > max_tp:
                continue
            spec = load_model_spec(model_dir)
            tconfig = transformer_config(spec, backend, tensor_parallel=tp, pipeline_parallel=pp)
            model = build_model(spec, tconfig, backend).eval()
            stats = load_hf_weights(model, spec, model_dir)
            out["read_fraction"][(name, tp, pp)] = stats.elements_read / _checkpoint_elements(model_dir)
            logits = megatron_logits(model, tokens % spec.vocab_size, tconfig)
            if reporter:
                real = logits[..., : spec.vocab_size]
                out["diffs"][(name, tp, pp)] = (real - reference).abs().max().item()
        if (tp, pp) == (2, 2):  # loader errors, raised before any parameter is written
            spec = load_model_spec(broken_dirs["missing"])
            model = build_model(spec, transformer_config(spec, backend, tensor_parallel=tp, pipeline_parallel=pp),
                                backend)
            for kind, model_dir in broken_dirs.items():
                try:
                    load_hf_weights(model, spec, model_dir)
                    out["errors"][kind] = None
                except HFCheckpointError as exc:
                    out["errors"][kind] = str(exc)
    return out


def _checkpoint_elements(model_dir: str) -> int:
    from safetensors import safe_open

    with safe_open(Path(model_dir) / "model.safetensors", framework="pt") as f:
        return sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())


def _break_checkpoint(src: Path, dst: Path, *, drop: str | None = None, reshape: str | None = None) -> None:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    tokens = torch.randint(0, 10**6, (2, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    cases = {}
    for i, (name, (config, max_tp)) in enumerate(_configs().items()):
        model = save_random_hf_model(root / name, config, seed=10 + i)
        with torch.no_grad():
            reference = model(tokens % config.vocab_size).logits
        cases[name] = (str(root / name), reference, max_tp)
    qwen = root / "qwen2_untied_v101"
    broken = {"missing": root / "missing", "shape": root / "shape"}
    _break_checkpoint(qwen, broken["missing"], drop="model.layers.3.mlp.up_proj.weight")
    _break_checkpoint(qwen, broken["shape"], reshape="model.layers.2.self_attn.k_proj.weight")
    results = run_distributed(_parity_job, 4, cases, LAYOUTS, tokens, {k: str(v) for k, v in broken.items()},
                              timeout_s=600)
    merged = {"diffs": {}, "errors": {kind: None for kind in broken}, "read_fraction": {}}
    # each error is raised by the stage holding the broken tensor (layers 2-3: stage 1)
    for rank, r in enumerate(results):
        merged["diffs"].update(r["diffs"])
        merged["read_fraction"].update({(*k, rank): v for k, v in r["read_fraction"].items()})
        merged["errors"].update({k: v for k, v in r["errors"].items() if v is not None})
    return merged


def test_logits_match_hf_at_every_layout(parity):
    expected = {(name, tp, pp) for name, (_, max_tp) in _configs().items() for tp, pp in LAYOUTS
                if max_tp is None or tp <= max_tp}
    diffs = parity["diffs"]
    assert set(diffs) == expected
    print("\nmax |logit diff| vs HF:", json.dumps({f"{n} TP{t}/PP{p}": f"{d:.2e}" for (n, t, p), d in diffs.items()}))
    bad = {k: v for k, v in diffs.items() if not v <= TOLERANCE}
    assert not bad, f"logit parity above {TOLERANCE}: {bad}"


def test_loader_reads_only_this_ranks_slices(parity):
    fractions = parity["read_fraction"]
    full = [v for (name, tp, pp, _), v in fractions.items() if (tp, pp) == (1, 1)]
    quarter = [v for (name, tp, pp, _), v in fractions.items() if (tp, pp) == (2, 2)]
    assert full and all(v == pytest.approx(1.0) for v in full)  # TP1/PP1 reads every element exactly once
    assert quarter and max(quarter) < 0.3, quarter  # TP2/PP2: about a quarter each (norms are replicated)


def test_loader_names_missing_tensor_and_shape_mismatch(parity):
    errors = parity["errors"]
    assert errors["missing"] is not None and "model.layers.3.mlp.up_proj.weight" in errors["missing"]
    assert errors["shape"] is not None and "model.layers.2.self_attn.k_proj.weight" in errors["shape"]
    assert "[15, 48]" in errors["shape"] and "[16, 48]" in errors["shape"]


def test_tp_larger_than_kv_heads_is_a_clear_error_up_front():
    spec = model_spec_from_hf(tiny_hf_config("qwen2", num_kv_heads=1))
    with pytest.raises(ParallelLayoutError, match=r"num_key_value_heads=1 is not divisible by tensor_parallel=2"):
        transformer_config(spec, select_backend(), tensor_parallel=2, pipeline_parallel=1)


def test_unsupported_architecture_and_rope_scaling_are_named():
    from transformers import MistralConfig

    with pytest.raises(UnsupportedModelError, match="model_type='mistral'"):
        model_spec_from_hf(MistralConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                         intermediate_size=64, vocab_size=64))
    config = tiny_hf_config("llama")
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        model_spec_from_hf(config)
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 2.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(UnsupportedModelError, match="low_freq_factor"):
        model_spec_from_hf(config)


def test_spec_reads_rope_base_from_rope_parameters_and_qwen2_bias():
    spec = model_spec_from_hf(tiny_hf_config("qwen2", rope_theta=123456.0, rms_norm_eps=1e-6))
    assert spec.rope_theta == 123456.0 and spec.qkv_bias and spec.rms_norm_eps == 1e-6
    assert spec.queries_per_group == 3 and spec.head_dim == 8
    assert not model_spec_from_hf(tiny_hf_config("llama")).qkv_bias


def test_fp8_without_transformer_engine_is_a_clear_error():
    spec = model_spec_from_hf(tiny_hf_config("qwen2"))
    with pytest.raises(UnsupportedModelError, match="Transformer Engine"):
        transformer_config(spec, select_backend(cuda_available=True, transformer_engine=False), tensor_parallel=1,
                           pipeline_parallel=1, precision="fp8")
