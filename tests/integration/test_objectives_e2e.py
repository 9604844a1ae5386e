"""GSPO and CISPO train the tiny example end to end (examples/tiny_cpu_gspo.yaml, tiny_cpu_cispo.yaml): a short
run of the whole loop — embedded engine, advantages, π_old, rollout correction, megatron updates, weight handoff —
logs a finite loss and moves every parameter, with dynamic sampling and the overlong penalty on. CISPO runs with
token-level TIS (the weights enter as per-token advantages)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


# A random model is never right: its responses would all score −1, every advantage 0 and no update made. This reward
# splits each group by the parity of the response's length instead, so dynamic sampling keeps the mixed groups. The
# random model never stops either: overlong filtering would take every response out of the loss, so it is off (the
# overlong penalty stays on).
PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if len(solution_str) % 2 else -1.0
"""


def short_run(run_dir: Path, *extra: str) -> list[str]:
    reward = run_dir / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    return [f"trainer.run_dir={run_dir}", "warm_start.enabled=false", "trainer.total_steps=1",
            "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
            "data.synthetic.num_train=200", "data.synthetic.num_heldout=8", "eval.every=0", "trainer.save_every=0",
            "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4", "algorithm.overlong_filtering=false",
            "algorithm.dynamic_sampling=true",
            "algorithm.gen_batch_size=8", "algorithm.max_gen_rounds=2", f"reward.function={reward}:compute_score",
            "reward.num_workers=1", "model.tiny.hidden_size=32", "model.tiny.num_layers=2",
            "model.tiny.intermediate_size=64", *extra]


@pytest.mark.parametrize("objective,extra", [("gspo", ()), ("cispo", ("algorithm.rollout_correction=token_tis",))])
def test_objective_trains_the_tiny_example(tmp_path, objective, extra):
    from spawn_ranks import run_distributed
    from trainer_harness import run_trainer

    config = REPO / "examples" / f"tiny_cpu_{objective}.yaml"
    (result,) = run_distributed(run_trainer, 1, short_run(tmp_path, *extra), config)
    assert result["changed"] == result["num_params"]  # every parameter moved
    (row,) = [r for r in result["metrics"] if r["step"] == 1]
    assert row["actor/num_updates"] >= 1 and row["actor/skipped_updates"] == 0
    assert row["train/filter/kept_fraction"] > 0  # dynamic sampling on: what it kept trained
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert math.isfinite(row[key]), (key, row[key])
    assert row["actor/pg_clipfrac_lower"] == 0.0  # no dual clip outside dapo
