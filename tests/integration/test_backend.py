"""The backend seam (dapo_megatron/backend/): which backend a platform gets, that the production modules never name the
CPU path, and that the CUDA-without-Transformer-Engine backend computes the model — run here on CPU, under the CPU
compatibility layer, against the HF model."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch
from actor_harness import TINY_VOCAB, actor_settings, logprobs_and_gradients, random_samples, write_tiny_qwen2
from spawn_ranks import run_distributed

from dapo_megatron.backend_registry import select_backend
from dapo_megatron.cuda.backend import CudaLocalBackend, TransformerEngineBackend
from dapo_megatron.config import ConfigError
from dapo_megatron.cpu.backend import CpuBackend
from dapo_megatron.cpu.segment_packing import SegmentPacker
from dapo_megatron.policy.packing import ThdPacker

PACKAGE = Path(__file__).resolve().parents[2] / "dapo_megatron"


# ------------------------------------------------------------------------------------------------ the decision


def test_each_platform_gets_its_backend(caplog):
    assert isinstance(select_backend(cuda_available=False, transformer_engine=False), CpuBackend)
    assert isinstance(select_backend("local", cuda_available=False, transformer_engine=False), CpuBackend)
    assert isinstance(select_backend(cuda_available=True, transformer_engine=True), TransformerEngineBackend)
    assert isinstance(select_backend("local", cuda_available=True, transformer_engine=True), CudaLocalBackend)
    with caplog.at_level(logging.WARNING, logger="dapo_megatron.backend_registry"):
        chosen = select_backend("local", cuda_available=True, transformer_engine=False)
    assert isinstance(chosen, CudaLocalBackend) and not caplog.records  # chosen on purpose: nothing to warn about
    with caplog.at_level(logging.WARNING, logger="dapo_megatron.backend_registry"):
        fallback = select_backend("auto", cuda_available=True, transformer_engine=False)
    # a GPU without Transformer Engine gets the SDPA local spec, never the CPU path, and the log says so
    assert isinstance(fallback, CudaLocalBackend) and not isinstance(fallback, CpuBackend)
    assert "transformer-engine[pytorch]" in caplog.text and "model.kernels=local" in caplog.text


def test_transformer_engine_on_request_is_refused_naming_what_is_missing():
    with pytest.raises(ConfigError, match=r"transformer-engine\[pytorch\]"):
        select_backend("transformer_engine", cuda_available=True, transformer_engine=False)
    with pytest.raises(ConfigError, match="CUDA"):
        select_backend("transformer_engine", cuda_available=False, transformer_engine=True)
    with pytest.raises(ConfigError, match="model.kernels='te'"):
        select_backend("te")
    assert isinstance(select_backend("transformer_engine", cuda_available=True, transformer_engine=True),
                      TransformerEngineBackend)  # control: with both present it is taken


def test_what_each_backend_supplies():
    from tiny_models import tiny_hf_config

    from dapo_megatron.cpu.attention import PackedSequenceAttention
    from dapo_megatron.cpu.shm_gather import SharedMemoryGather
    from dapo_megatron.handoff.tp_gather import ProcessGroupGather
    from dapo_megatron.policy.model_spec import model_spec_from_hf
    from dapo_megatron.policy.sdpa_attention import ThdSdpaAttention

    spec = model_spec_from_hf(tiny_hf_config("qwen2"))
    cuda = CudaLocalBackend()
    layer = cuda.layer_spec(spec, 2)
    assert layer.submodules.self_attention.submodules.core_attention is ThdSdpaAttention
    assert isinstance(cuda.packer, ThdPacker) and isinstance(cuda.tp_gather, ProcessGroupGather)
    assert not cuda.rope_in_attention and cuda.collective == "nccl" and cuda.recompute("full") == "full"
    assert cuda.sglang_server_environment({"A": "1"}) == {"A": "1"}

    cpu = CpuBackend()
    block = cpu.layer_spec(spec, 2)
    assert block.layer_specs[0].submodules.self_attention.submodules.core_attention.module is PackedSequenceAttention
    assert isinstance(cpu.packer, SegmentPacker) and isinstance(cpu.tp_gather, SharedMemoryGather)
    assert cpu.rope_in_attention and cpu.collective == "gloo" and cpu.recompute("full") == "none"
    environment = cpu.sglang_server_environment({"PYTHONPATH": "/mine"})
    assert environment["SGLANG_USE_CPU_ENGINE"] == "1" and environment["PYTHONPATH"].endswith(":/mine")


# ------------------------------------------------------------------------------------------------ the seam


SEAM_FOLDERS = ("policy", "rollout", "handoff", "trainer", "collectors", "run", "metrics", "reward", "algorithm",
                "data", "backend", "cuda", "tools", "commands")


# The CPU path outside the CPU folder: megatron-core's CPU compatibility layer sits with the other overrides.
CPU_MODULES = ("dapo_megatron.cpu", "dapo_megatron.overrides.megatron_core.cpu_compat")


def cpu_imports(source: str) -> list[str]:
    """The imports of ``source`` that name the CPU path (:data:`CPU_MODULES` or a module under them)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [name for name in names if any(name == cpu or name.startswith(cpu + ".") for cpu in CPU_MODULES)]
    return sorted(set(found))


def test_no_production_module_names_the_cpu_path():
    offenders = {}
    for folder in SEAM_FOLDERS:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            names = cpu_imports(path.read_text())
            if names:
                offenders[str(path.relative_to(PACKAGE))] = names
    assert offenders == {}
    # control: the check sees an import of the CPU folder, in either form
    assert cpu_imports("from dapo_megatron.cpu.attention import X\nfrom dapo_megatron import cpu") == [
        "dapo_megatron.cpu", "dapo_megatron.cpu.attention", "dapo_megatron.cpu.attention.X"]
    assert cpu_imports("from dapo_megatron.overrides.megatron_core import cpu_compat") == [
        "dapo_megatron.overrides.megatron_core.cpu_compat"]
    assert cpu_imports((PACKAGE / "backend_registry.py").read_text()) == [
        "dapo_megatron.cpu.backend", "dapo_megatron.cpu.backend.CpuBackend"]  # the registry may, and does


# ------------------------------------------------------------------------------------------------ CUDA without TE


def sdpa_backend_job(hf_dir: str, tensor_parallel: int):
    """The CUDA-without-TE backend's model on CPU (the compatibility layer redirects its CUDA placements): per-sample
    log-probs from THD packed rows and from each sample alone, gradients of both, and the control of a THD row whose
    boundaries were dropped (attention across samples)."""
    from dataclasses import replace

    from megatron.core import parallel_state

    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.policy.actor import build_actor
    from dapo_megatron.policy.batch_plan import PackedBatching
    from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec
    from dapo_megatron.policy.sdpa_attention import ThdSdpaAttention

    init_distributed(tensor_parallel, 1)  # the CPU backend prepares the process
    seed_everything(0)
    backend = CudaLocalBackend()
    spec = load_model_spec(hf_dir)
    actor = build_actor(spec, backend=backend, **actor_settings())
    load_hf_weights(actor.model, spec, hf_dir)
    actor.optimizer.reload_model_params()
    assert any(isinstance(m, ThdSdpaAttention) for m in actor.model.modules())
    samples = random_samples(7, seed=3, prompt_lengths=(1, 9), response_lengths=(1, 25))
    weights = [torch.rand(s.response_length, generator=torch.Generator().manual_seed(i)) + 0.5
               for i, s in enumerate(samples)]
    from baseline_packing import PaddedPacker

    results = {}
    for name, packer, budget in (("thd", ThdPacker(), 40), ("alone", PaddedPacker(samples_per_micro_batch=1), 1)):
        backend.packer = packer
        result = logprobs_and_gradients(actor, samples, weights, PackedBatching(token_budget=budget, pad_to_multiple=4),
                                        temperature=0.8)
        results[name] = dict(result, micro_batches=len(result["micro_batches"]))
    backend.packer = ThdPacker()
    (mb, *_) = actor.plan(samples, PackedBatching(token_budget=4096)).micro_batches
    row = mb.packed_seq_params
    total = sum(row.segment_lengths)
    one_segment = replace(row, cu_seqlens_q=torch.tensor([0, total], dtype=torch.int32),
                          cu_seqlens_kv=torch.tensor([0, total], dtype=torch.int32), max_seqlen_q=total,
                          max_seqlen_kv=total, segment_lengths=(total,))
    with torch.no_grad():
        logits = actor.model(mb.tokens, mb.position_ids, None, packed_seq_params=one_segment)
        rows, _ = actor.response_logprobs(mb, logits, temperature=0.8)
    results["leaky"] = {index: rows[r, :samples[index].response_length] for r, index in enumerate(mb.sample_indices)}
    results["reporter"] = parallel_state.get_tensor_model_parallel_rank() == 0
    return results


@pytest.mark.parametrize("tensor_parallel", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_cuda_without_te_backend_equals_the_hf_model(tmp_path, tensor_parallel):
    from transformers import AutoModelForCausalLM

    hf_dir = write_tiny_qwen2(tmp_path / "hf")
    results = run_distributed(sdpa_backend_job, tensor_parallel, str(hf_dir), tensor_parallel)[0]
    thd, alone = results["thd"], results["alone"]
    assert thd["micro_batches"] > 1 and alone["micro_batches"] == 7  # several samples per THD row, and rows
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert hf.config.vocab_size == TINY_VOCAB
    leaked = 0.0
    for i, s in enumerate(random_samples(7, seed=3, prompt_lengths=(1, 9), response_lengths=(1, 25))):
        with torch.no_grad():
            logits = hf(torch.cat([s.prompt_ids, s.response_ids])[None]).logits[0].double() / 0.8
        expected = torch.log_softmax(logits, -1)[s.prompt_length - 1:-1].gather(-1, s.response_ids[:, None])[:, 0]
        torch.testing.assert_close(thd["logprobs"][i].double(), expected, atol=2e-5, rtol=0)
        torch.testing.assert_close(alone["logprobs"][i].double(), expected, atol=2e-5, rtol=0)
        leaked = max(leaked, float((results["leaky"][i].double() - expected).abs().max()))
    assert leaked > 1e-2  # control: attention across the samples of a row is far outside that tolerance
    for name, grad in alone["grads"].items():
        torch.testing.assert_close(thd["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=name)
