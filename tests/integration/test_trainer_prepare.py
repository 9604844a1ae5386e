"""Model preparation as its own step: ``dapo-megatron prepare-tiny`` makes the same HF folder (weights, tokenizer,
warm-start) that ``dapo-megatron train`` makes for itself, and under several ranks ``train`` prepares it on rank 0
while the others wait — a failure there reaches every rank as the same error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny_cpu.yaml"
SMALL = ["data.synthetic.num_train=200", "data.synthetic.num_heldout=8", "model.tiny.hidden_size=32",
         "model.tiny.num_layers=2", "model.tiny.intermediate_size=64", "rollout.max_response_length=24",
         "algorithm.overlong_buffer_len=4"]
WARM_START = ["warm_start.enabled=true", "warm_start.max_steps=4", "warm_start.eval_every=2",
              "warm_start.batch_size=16"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dapo_megatron.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=900)


def _folder(path: Path) -> dict[str, object]:
    """The prepared folder's files; the warm-start report without its wall-clock seconds."""
    files: dict[str, object] = {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "warm_start.json"}
    report = json.loads((path / "warm_start.json").read_text())
    report.pop("seconds")
    files["warm_start.json"] = report
    return files


@pytest.mark.slow
def test_prepare_tiny_makes_the_model_train_would_make(tmp_path):
    prepared = tmp_path / "prepared"
    result = _cli("prepare-tiny", str(TINY), *SMALL, *WARM_START, f"trainer.run_dir={tmp_path / 'unused'}",
                  "--out", str(prepared))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"tiny model: {prepared.resolve()}" in result.stdout
    assert not (tmp_path / "unused").exists()  # --out: nothing written where train would look

    one_go = tmp_path / "one_go"
    result = _cli("train", str(TINY), *SMALL, *WARM_START, f"trainer.run_dir={one_go}", "trainer.total_steps=0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _folder(prepared) == _folder(one_go / "initial_model")
    assert _folder(prepared)["warm_start.json"]["steps"] == 4

    from_folder = tmp_path / "from_folder"
    result = _cli("train", str(TINY), *SMALL, *WARM_START, f"trainer.run_dir={from_folder}", "trainer.total_steps=0",
                  "model.source=hf", f"model.hf_path={prepared}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (from_folder / "initial_model").exists()  # a user's folder is used as is
    first_eval = [json.loads((run / "metrics.jsonl").read_text()) for run in (one_go, from_folder)]
    assert first_eval[0] == first_eval[1] and "val/all/acc/mean@1" in first_eval[0]


def test_prepare_tiny_refuses_a_config_for_a_user_model(tmp_path):
    result = _cli("prepare-tiny", str(TINY), "model.source=hf", f"model.hf_path={tmp_path}")
    assert result.returncode == 2 and "model.source" in result.stderr, result.stderr[-2000:]


def _prepare_on_every_rank(run_dir: str, not_a_dir: str) -> dict:
    """What ``train`` does before building the trainer, on each rank: first for a run directory that cannot be made
    (a file is in the way), then for a good one, twice."""
    from dapo_megatron.config import load_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.rank_zero import Rank0Error
    from dapo_megatron.run.model_source import prepare_initial_model

    init_distributed(timeout_s=120)
    try:
        prepare_initial_model(load_config(TINY, [*SMALL, "warm_start.enabled=false", f"trainer.run_dir={not_a_dir}"]))
        error = None
    except Rank0Error as exc:
        error = str(exc)
    config = load_config(TINY, [*SMALL, "warm_start.enabled=false", f"trainer.run_dir={run_dir}"])
    first = prepare_initial_model(config)
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = prepare_initial_model(config)
    return {"error": error, "first": str(first), "again": str(again), "rebuilt": weights.stat().st_mtime_ns != stamp}


@pytest.mark.slow
def test_train_prepares_on_rank0_and_every_rank_gets_the_folder_or_the_error(tmp_path):
    from spawn_ranks import run_distributed

    blocker = tmp_path / "a_file"
    blocker.write_text("in the way\n")
    rank0, rank1 = run_distributed(_prepare_on_every_rank, 2, str(tmp_path / "run"), str(blocker), timeout_s=600)
    assert rank0["error"] == rank1["error"] and rank0["error"].startswith("preparing the tiny model failed on rank 0:")
    expected = str(tmp_path / "run" / "initial_model")
    assert rank0["first"] == rank1["first"] == rank0["again"] == rank1["again"] == expected
    assert not rank0["rebuilt"] and not rank1["rebuilt"]  # the complete folder is reused, not made again
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["initial_model"]  # no .tmp left behind
