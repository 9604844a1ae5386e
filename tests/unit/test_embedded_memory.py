"""rollout.engine=embedded on a big model (issue 26, item 8): the engine keeps an fp32 copy of the whole model in rank
0's host memory and decodes on its CPU, also on GPU runs; the copy is counted before anything is built and a run whose
host cannot hold it is refused with the numbers named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo_megatron.backend_registry import select_backend
from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.policy.model_spec import model_spec_from_hf
from dapo_megatron.policy.shapes import published_hf_config
from dapo_megatron.rollout.embedded.memory import embedded_engine_bytes, embedded_parameters
from dapo_megatron.run.input_checks import check_embedded_engine_memory

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
GIB = 2**30


@pytest.mark.parametrize("name", ["Qwen2.5-0.5B", "Qwen2.5-32B"])
def test_the_count_is_the_parameters_of_the_model_the_engine_builds(name):
    hf_config = published_hf_config(name)
    with torch.device("meta"):  # the engine's HF model, without memory
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    assert embedded_parameters(model_spec_from_hf(hf_config)) == sum(p.numel() for p in model.parameters())


def _config():
    return load_config(TINY, ["model.source=hf", "model.hf_path=/models/Qwen2.5-32B", "model.precision=bf16",
                              "rollout.engine=embedded"])


def test_a_32b_embedded_engine_on_a_gpu_host_without_room_is_refused_naming_the_numbers():
    config, spec = _config(), model_spec_from_hf(published_hf_config("Qwen2.5-32B"))
    gpu = select_backend(cuda_available=True, transformer_engine=False)
    engine = embedded_engine_bytes(spec, config.rollout.embedded)
    assert engine["weights"] / GIB == pytest.approx(122.1, abs=0.05)  # 32.76B parameters × 4 bytes
    with pytest.raises(ConfigError) as refused:
        check_embedded_engine_memory(config, spec, world_size=64, backend=gpu, available_host_bytes=128 * GIB,
                                     ranks_on_host=8)
    message = str(refused.value)
    assert "32.76B parameters: 122.1 GiB" in message and "decodes on its CPU (the GPUs only train)" in message
    assert "8 trainer rank(s) on this host (7.5 GiB)" in message and "128.0 GiB available" in message
    assert message.endswith("use rollout.engine=sglang") and "\n" not in message
    # Control: the same run on a host with room for it passes.
    check_embedded_engine_memory(config, spec, world_size=64, backend=gpu, available_host_bytes=512 * GIB,
                                 ranks_on_host=8)


def test_on_cpu_the_trainer_ranks_training_estimate_shares_the_host():
    config = load_config(TINY, ["model.source=hf", "model.hf_path=/models/Qwen2.5-0.5B", "rollout.engine=embedded"])
    spec = model_spec_from_hf(published_hf_config("Qwen2.5-0.5B"))
    cpu = select_backend(cuda_available=False)
    engine = sum(embedded_engine_bytes(spec, config.rollout.embedded).values())
    room = engine + 2 * GIB  # the engine and two processes' own cost, but not their training memory
    check_embedded_engine_memory(config, spec, world_size=2, backend=select_backend(cuda_available=True,
                                 transformer_engine=False), available_host_bytes=room, ranks_on_host=2)
    with pytest.raises(ConfigError, match=r"2 trainer rank\(s\) on this host"):
        check_embedded_engine_memory(config, spec, world_size=2, backend=cpu, available_host_bytes=room,
                                     ranks_on_host=2)


def test_train_and_eval_check_it_with_the_model_folder(monkeypatch):
    """check_run_inputs (rank 0, before anything is built) runs the check for the user's model; this host's
    available memory is replaced by one that cannot hold a 32B copy."""
    import psutil

    from dapo_megatron.run import input_checks

    spec = model_spec_from_hf(published_hf_config("Qwen2.5-32B"))
    monkeypatch.setattr(input_checks, "check_user_model", lambda config: spec)
    monkeypatch.setattr(input_checks, "check_training_memory", lambda *args, **kwargs: None)
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: type("Memory", (), {"available": 64 * GIB, "total": 64 * GIB})())
    with pytest.raises(ConfigError, match="rollout.engine=embedded keeps an fp32 copy"):
        input_checks.check_run_inputs(_config(), world_size=1, backend=select_backend(cuda_available=False))
    input_checks.check_run_inputs(load_config(TINY, ["model.source=hf", "model.hf_path=/models/Qwen2.5-32B",
                                                    "rollout.engine=sglang"]),
                                  world_size=1, backend=select_backend(cuda_available=False))  # control: sglang
