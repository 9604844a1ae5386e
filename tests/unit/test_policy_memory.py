"""estimate_memory against hand-computed numbers, the 32B example fitting 80 GB (and not without sequence parallelism
and recomputation), and `dapo-megatron plan`."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_megatron.policy.memory.gpu import estimate_memory
from dapo_megatron.policy.model_spec import ModelSpec

REPO = Path(__file__).resolve().parents[2]
SMALL = ModelSpec(arch="qwen2", vocab_size=101, hidden_size=64, num_layers=4, num_attention_heads=8, num_kv_heads=2,
                  head_dim=8, ffn_hidden_size=128, rms_norm_eps=1e-6, rope_theta=1e4, qkv_bias=True,
                  tie_embeddings=False, max_position_embeddings=256)
LAYOUT = dict(tensor_parallel=2, pipeline_parallel=2, data_parallel=2, micro_batch_tokens=100)


def test_small_config_by_hand():
    """h 64, q 64, k 16, F 128, V 101 → 256 at TP 2; TP 2 × PP 2 × DP 2, 100 tokens, bf16, SP, no recompute.

    Layer per TP rank: ((64+32)·64 + 64·64 + 3·128·64 + 96) / 2 + 2·64 = 17584; embedding / output 256·64/2 = 8192.
    Activations per token per layer: 4·64/2 + (64+32+64+3·128)/2 = 400 values.
    """
    first, last = estimate_memory(SMALL, **LAYOUT, precision="bf16", recompute="none", sequence_parallel=True)
    assert (first.parameters, last.parameters) == (2 * 17584 + 8192, 2 * 17584 + 64 + 8192)
    assert (first.params_bytes, first.grads_bytes, first.optimizer_bytes) == (43360 * 2, 43360 * 4, 43360 * 6)
    assert first.micro_batches_in_flight == 2 and last.micro_batches_in_flight == 1
    assert first.activations_bytes == 2 * 2 * 400 * 100 * 2
    assert last.activations_bytes == (2 * 400 * 100 + 2 * 32 * 100) * 2
    assert first.logits_bytes == 0
    assert last.logits_bytes == 2 * 100 * 128 * 2 + 4 * 100 * 128 * 4 + 2 * 100 * 128 * 2  # + 2 bf16 chunk copies
    assert first.margin_bytes == 3 * 10**9 + int(0.1 * first.activations_bytes)
    assert first.total_bytes == sum((first.params_bytes, first.grads_bytes, first.optimizer_bytes,
                                     first.activations_bytes, first.logits_bytes, first.margin_bytes))


def test_sequence_parallelism_and_recomputation_by_hand():
    no_sp = estimate_memory(SMALL, **LAYOUT, recompute="none", sequence_parallel=False)[0]
    assert no_sp.activations_bytes == 2 * 2 * (4 * 64 + 272) * 100 * 2  # the norm region no longer split over TP
    unfused = estimate_memory(SMALL, **LAYOUT, recompute="none", fused_attention=False)[0]
    assert unfused.activations_bytes == 2 * 2 * (400 * 100 + 8 // 2 * 100 * 100) * 2  # + a/T · t² softmax
    selective = estimate_memory(SMALL, **LAYOUT, recompute="selective", fused_attention=False)[0]
    assert selective.activations_bytes == 2 * 2 * 400 * 100 * 2  # the softmax is recomputed
    full = estimate_memory(SMALL, **LAYOUT, recompute="full", fused_attention=False)[0]
    assert full.activations_bytes == (2 * 2 * 32 * 100 + 400 * 100 + 4 * 100 * 100) * 2  # inputs + one layer
    fp32 = estimate_memory(SMALL, **LAYOUT, precision="fp32", distributed_optimizer=False)[0]
    assert fp32.params_bytes == 43360 * 4 and fp32.optimizer_bytes == 43360 * 8  # no master copy, not sharded


def qwen32b():
    from dapo_megatron.policy.model_spec import model_spec_from_hf
    from dapo_megatron.policy.shapes import published_hf_config

    return model_spec_from_hf(published_hf_config("Qwen2.5-32B"))


def test_32b_example_fits_80gb_and_would_not_without_sp_and_recompute():
    from dapo_megatron.config import load_config
    from dapo_megatron.policy.memory.gpu import plan_stages

    config = load_config(REPO / "examples" / "dapo_qwen2.5_32b.yaml")
    stages, sequence_parallel = plan_stages(config, qwen32b(), data_parallel=config.parallel.data)
    assert sequence_parallel and config.parallel.data == 4 and config.model.recompute == "selective"
    assert all(stage.total_bytes <= 80e9 for stage in stages), [s.total_bytes / 1e9 for s in stages]
    assert stages[0].parameters == pytest.approx(2.05e9, rel=0.01)  # slurm/README.md's count
    assert stages[0].activations_bytes == pytest.approx(45.5e9, rel=0.01)

    off = load_config(REPO / "examples" / "dapo_qwen2.5_32b.yaml",
                      ["parallel.sequence_parallel=false", "model.recompute=none"])
    stages_off, sp_off = plan_stages(off, qwen32b(), data_parallel=4)
    assert not sp_off
    assert stages_off[0].activations_bytes > 100e9 and stages_off[0].total_bytes > 80e9


def test_plan_command_prints_every_stage_and_exit_code_says_whether_it_fits(capsys):
    from dapo_megatron.cli import main

    assert main(["plan", str(REPO / "examples" / "dapo_qwen2.5_32b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "published Qwen2.5-32B shape" in out and "TP 8 x PP 2 x DP 4" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[-1] == "yes" for row in rows)
    assert "fits in 80 GB per GPU" in out
    assert main(["plan", str(REPO / "examples" / "dapo_qwen2.5_32b.yaml"), "parallel.sequence_parallel=false",
                 "model.recompute=none"]) == 1
    assert "does NOT fit" in capsys.readouterr().out


def test_plan_reads_a_local_config_json(tmp_path, capsys):
    from transformers import Qwen2Config

    from dapo_megatron.cli import main

    Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path / "model")
    assert main(["plan", str(REPO / "examples" / "dapo_qwen2.5_32b.yaml"), f"model.hf_path={tmp_path / 'model'}",
                 "parallel.tensor=2", "--data-parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "model" / "config.json") in out and "TP 2 x PP 2 x DP 2" in out
    assert main(["plan", str(REPO / "examples" / "dapo_qwen2.5_32b.yaml"), "model.hf_path=/nowhere/unknown"]) == 2
