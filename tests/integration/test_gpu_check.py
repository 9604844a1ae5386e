"""scripts/gpu_check.sh --tiny: the GPU check's code on CPU, so it cannot rot — one table, every row, finite numbers.
And the check's megatron-core install: without megatron-core and without a wheel it stops with the recipe."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROWS = ("bf16 matmul", "logprob parity bf16 vs fp32", "DAPO updates", "weight handoff -> embedded engine loader",
        "engine vs policy logprob gap (bf16)", "colocated turn: optimizer state to host and back",
        "colocated MoE turn: no distributed optimizer, routing replayed", "routing replay with full recomputation",
        "SGLang on this GPU", "training MFU 0.5B-shaped", "training MFU 1.5B-shaped")


@pytest.mark.slow  # ~15 s of work, longer on a loaded machine
def test_tiny_gpu_check_prints_every_row_with_finite_numbers(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--tiny", "--json", str(out)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].split("|")[1].strip() == "check" and len(table) == 1 + len(ROWS)
    rows = json.loads(out.read_text())
    assert len(rows) == len(ROWS)
    for row, prefix in zip(rows, ROWS):
        assert row["check"].startswith(prefix), (row["check"], prefix)
        assert any(line.split("|")[1].strip() == row["check"] for line in table)
        assert row["numbers"] and all(math.isfinite(v) for v in row["numbers"].values()), row
    by_name = {row["check"].split(" (")[0]: row for row in rows}
    assert by_name["DAPO updates"]["value"] == "ok" and by_name["DAPO updates"]["numbers"]["skipped"] == 0
    assert by_name["DAPO updates"]["numbers"]["max_weight_change"] > 0
    assert 0 < by_name["logprob parity bf16 vs fp32"]["numbers"]["mean_abs"] < 0.05  # bf16 differs, a little
    handoff = by_name["weight handoff -> embedded engine loader"]["numbers"]
    assert handoff["handoff_gbps"] > 0 and handoff["copy_gbps"] > 0
    assert all(row["numbers"]["mfu"] > 0 for row in rows if row["check"].startswith("training MFU"))
    colocated = by_name["colocated turn: optimizer state to host and back"]
    assert colocated["value"] == "ok" and colocated["numbers"]["round_trip_exact"] == 1.0
    assert colocated["numbers"]["moved_gb"] == 0 and colocated["numbers"]["planned_optimizer_gb"] > 0  # CPU: stays
    moe = by_name["colocated MoE turn: no distributed optimizer, routing replayed"]
    assert moe["value"] == "ok" and moe["numbers"]["stray_parameters"] == 0 and moe["numbers"]["routing_on_host"] == 1
    replay = by_name["routing replay with full recomputation"]
    assert replay["value"] == "ok" and replay["numbers"]["queued_bytes_plain"] == 0  # issue 40.3: nothing queued
    assert replay["numbers"]["router_forwards_recomputed"] > 0 and replay["numbers"]["loss_recomputed"] != 0
    sglang = next(row for row in rows if row["check"].startswith("SGLang on this GPU"))
    assert sglang["value"] == "skipped" and "no CUDA" in sglang["detail"]  # CPU: R3 needs a CUDA server
    timed = [row for row in rows if row["check"].startswith(("training MFU", "logprob parity", "DAPO updates"))]
    assert timed and all(row["check"].endswith("[cpu]") for row in timed)  # each names the layers it ran


def test_the_mfu_rows_time_the_layers_a_run_uses():
    """Issue 26, item 9: with Transformer Engine importable a run trains on TE's layers, so the check times them (and
    the local spec next to them); without it, the local spec, labelled as such."""
    from gpu_check import mfu_kernels

    from dapo_megatron.backend_registry import select_backend

    assert mfu_kernels(True, True) == ("transformer_engine", "local")
    assert mfu_kernels(True, False) == ("local",)
    assert mfu_kernels(False, True) == mfu_kernels(False, False) == ("auto",)
    names = {kernels: select_backend(kernels, cuda_available=True, transformer_engine=True).name
             for kernels in mfu_kernels(True, True)}
    assert names == {"transformer_engine": "cuda+transformer_engine", "local": "cuda+local_sdpa"}
    assert select_backend("auto", cuda_available=True, transformer_engine=True).name == names["transformer_engine"]


def test_without_megatron_and_without_a_wheel_the_check_says_how_to_make_one(tmp_path):
    bare = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    env = {**os.environ, "PYTHON": str(bare / "bin" / "python"), "DAPO_WHEEL_DIR": str(tmp_path / "no_wheels"),
           "PYTHONPATH": ""}
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--tiny"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert "no megatron_core-*.whl in" in result.stderr and "header" in result.stderr
