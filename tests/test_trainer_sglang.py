"""Two DAPO steps with a real SGLang server on CPU generating the rollouts (examples/tiny_cpu_sglang.yaml), the
Megatron policy at TP=2: it trains, its TP shards are gathered into HF tensors and reach the server through the disk
transport, the server reports the new weight_version, and the server's log-probs agree with the policy's recomputed
log-probs for the tokens it sampled."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from dapo_megatron.rollout.engine import RolloutError
from dapo_megatron.rollout.sglang_server import require_sglang
from trainer_harness import run_trainer

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.sglang]


def test_dapo_steps_with_a_real_sglang_server(tmp_path):
    from spawn_ranks import run_distributed

    python = os.environ.get("DAPO_SGLANG_PYTHON", sys.executable)
    try:
        require_sglang(python)
    except RolloutError as error:
        pytest.skip(f"SGLang is not importable by {python}: {error}")
    overrides = [f"trainer.run_dir={tmp_path}", f"rollout.sglang.python={python}", "warm_start.enabled=false",
                 "trainer.total_steps=2", "trainer.train_batch_size=4", "trainer.mini_batch_size=2",
                 "rollout.n_samples=4", "data.synthetic.num_train=200", "data.synthetic.num_heldout=8",
                 "eval.every=0", "trainer.save_every=2", "rollout.max_response_length=24",
                 "algorithm.overlong_buffer_len=4", "algorithm.dynamic_sampling=false",
                 "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
                 "parallel.tensor=2"]
    result, other_rank = run_distributed(run_trainer, 2, overrides, REPO / "examples" / "tiny_cpu_sglang.yaml",
                                           timeout_s=1200)
    for rank_result in (result, other_rank):
        assert rank_result["changed"] == rank_result["num_params"] and not rank_result["padding_moved"]
    assert other_rank["num_params"] < result["num_params"]  # vocab 118 padded to 256: rank 1's vocab rows are padding
    assert result["version"] == 2
    rows = result["metrics"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
            assert math.isfinite(row[key]), (key, row[key])
        assert row["rollout/weight_version"] == row["step"]
        # fp32 server vs fp32 Megatron on the same sampled tokens
        assert row["rollout/logprob_diff/max_abs"] < 1e-3, row["rollout/logprob_diff/max_abs"]
    assert (tmp_path / "checkpoints" / "step_000002" / "COMPLETE").exists()
