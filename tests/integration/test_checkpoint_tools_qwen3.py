"""The checkpoint tools and distributed checkpoints for Qwen3 and Qwen3-MoE at TP × PP × EP (4 gloo ranks, torchrun
path: RANK/WORLD_SIZE set, so each conversion runs on the ranks it is handed, DP taking the rest).

* HF → megatron → HF bit-exact: Qwen3 (decoupled head_dim) at TP2×PP2, back at TP1; Qwen3-MoE with 6 experts
  written at TP2×EP2 and read back at PP2×EP2; with 5 experts (odd, so EP1) at TP2×PP2 and back at TP1.
* The MoE checkpoint written at TP2×EP2 loads at TP1×PP2×EP2 and at TP2×PP2×EP1 with HF's logits (megatron's
  distributed checkpoint reshards experts over EP like any other dimension).
* ``--ep`` on the command line and a layout whose EP does not divide the experts, refused before any rank starts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spawn_ranks import run_distributed
from test_checkpoint_tools import REPO_ROOT, _bit_differences
from logit_parity import TOLERANCE, checkpoint_logits
from tiny_models import save_random_hf_model
from tiny_qwen3 import EVEN_EXPERTS, ODD_EXPERTS, tiny_qwen3_config, tiny_qwen3_moe_config

from checkpoint_tools import ConversionError
from checkpoint_tools.hf_to_megatron import convert_hf_to_megatron

ROUND_TRIPS = {  # name → (written at TP, PP, EP), (read back at TP, PP, EP)
    "qwen3_dense": ((2, 2, 1), (1, 1, 1)),
    "qwen3_moe_6_experts": ((2, 1, 2), (1, 2, 2)),
    "qwen3_moe_5_experts": ((2, 2, 1), (1, 1, 1)),
}
RESHARDED = [(1, 2, 2), (2, 2, 1)]


def _configs():
    return {"qwen3_dense": tiny_qwen3_config(),
            "qwen3_moe_6_experts": tiny_qwen3_moe_config(num_experts=EVEN_EXPERTS, topk=2),
            "qwen3_moe_5_experts": tiny_qwen3_moe_config(num_experts=ODD_EXPERTS, topk=3)}


def _job(dirs: dict, root: str, tokens: torch.Tensor) -> dict:
    from checkpoint_tools.megatron_to_hf import convert_megatron_to_hf

    out: dict = {"round_trips": {}, "logits": {}}
    for name, ((tp, pp, ep), (back_tp, back_pp, back_ep)) in ROUND_TRIPS.items():
        ckpt, back = Path(root) / f"{name}_megatron", Path(root) / f"{name}_back"
        convert_hf_to_megatron(dirs[name], ckpt, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
        convert_megatron_to_hf(ckpt, back, tensor_parallel=back_tp, pipeline_parallel=back_pp,
                               expert_parallel=back_ep)
        out["round_trips"][name] = str(back)
    for tp, pp, ep in RESHARDED:
        logits = checkpoint_logits(str(Path(root) / "qwen3_moe_6_experts_megatron" / "model"),
                                   dirs["qwen3_moe_6_experts"], tokens, tp=tp, pp=pp, ep=ep)
        if logits is not None:
            out["logits"][(tp, pp, ep)] = logits
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_ckpt")
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(5))
    dirs, reference = {}, None
    for seed, (name, config) in enumerate(_configs().items()):
        dirs[name] = str(root / name)
        model = save_random_hf_model(dirs[name], config, seed=60 + seed)
        if name == "qwen3_moe_6_experts":
            with torch.no_grad():
                reference = model(tokens).logits
    results = run_distributed(_job, 4, dirs, str(root / "out"), tokens, timeout_s=1200)
    logits = {}
    for result in results:
        logits.update(result["logits"])
    return dirs, results[0]["round_trips"], logits, reference


@pytest.mark.slow  # 4 processes
@pytest.mark.parametrize("name", list(ROUND_TRIPS))
def test_round_trip_through_tp_pp_ep_is_bit_exact(converted, name):
    dirs, round_trips, _, _ = converted
    assert _bit_differences(Path(dirs[name]), Path(round_trips[name])) == []


@pytest.mark.slow  # 4 processes
def test_moe_checkpoint_written_at_tp2_ep2_loads_at_other_layouts_with_hf_logits(converted):
    _, _, logits, reference = converted
    assert set(logits) == set(RESHARDED)
    for layout, values in logits.items():
        diff = (values - reference).abs().max().item()
        assert diff <= TOLERANCE, f"TP×PP×EP={layout}: max |logit diff| vs HF {diff:.2e}"


def test_expert_parallel_that_does_not_divide_the_experts_is_refused(tmp_path):
    save_random_hf_model(tmp_path / "moe5", tiny_qwen3_moe_config(num_experts=ODD_EXPERTS), seed=1)
    with pytest.raises(ConversionError, match="num_experts=5 is not divisible by expert_parallel=2"):
        convert_hf_to_megatron(tmp_path / "moe5", tmp_path / "out", expert_parallel=2)
    assert not (tmp_path / "out").exists()
    cli = subprocess.run([sys.executable, "-m", "checkpoint_tools.hf_to_megatron", "--hf-dir", str(tmp_path / "moe5"),
                          "--out", str(tmp_path / "out"), "--ep", "2"], cwd=REPO_ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
                         timeout=300)
    assert cli.returncode == 2 and "expert_parallel=2" in cli.stderr, cli.stderr
