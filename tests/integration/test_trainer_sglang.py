"""Two DAPO steps with a real SGLang server on CPU generating the rollouts (examples/tiny_cpu_sglang.yaml), the
Megatron policy at TP=2: it trains, its TP shards are gathered into HF tensors and reach the server through the disk
transport, the server reports the new weight_version, and the server's log-probs agree with the policy's recomputed
log-probs for the tokens it sampled."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from trainer_harness import run_trainer, small_sglang_run

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.sglang]


def test_dapo_steps_with_a_real_sglang_server(tmp_path):
    from spawn_ranks import run_distributed

    overrides = small_sglang_run(tmp_path)
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
