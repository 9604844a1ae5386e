"""Two DAPO steps with ``rollout.placement: colocated`` and a real SGLang server on CPU (the Megatron policy at TP=2,
weights over the tensor transport): the trainer's turns reach the server in the order of a step — KV cache back before
every generation (the step's rollouts and validation) and released after it, the weights released before the policy
update and resumed just before the handoff pushes the new ones — and the run trains as the separate placement does
(tests/integration/test_trainer_sglang.py). The server log is what the server received; it would have died on a
resume of memory it held (tests/integration/test_sglang_colocated.py)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from trainer_harness import run_trainer, small_sglang_run

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.sglang]

CALLS = {"release_memory_occupation": "R", "resume_memory_occupation": "U", "update_weights_from_tensor": "T",
         "generate": "G"}


def received_turns(log: str) -> str:
    """The server's memory, weight and generate requests in order, one letter each, repeats of T and G merged."""
    letters = "".join(CALLS[name] for name in re.findall(r'"POST /(\w+) HTTP', log) if name in CALLS)
    return re.sub(r"T+", "T", re.sub(r"G+", "G", letters))


def test_dapo_steps_with_a_colocated_sglang_server(tmp_path):
    from spawn_ranks import run_distributed

    overrides = small_sglang_run(tmp_path) + [  # later overrides win
        "eval.every=1", "data.synthetic.num_heldout=4", "rollout.placement=colocated",
        "rollout.sglang.transport=tensor", "rollout.sglang.mem_fraction_static=0.5", "rollout.offload_optimizer=true"]
    result, _ = run_distributed(run_trainer, 2, overrides, REPO / "examples" / "tiny_cpu_sglang.yaml",
                                timeout_s=1200)
    assert result["changed"] == result["num_params"] and result["version"] == 2
    for row in result["metrics"][1:]:
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
            assert math.isfinite(row[key]), (key, row[key])
        assert row["rollout/weight_version"] == row["step"]
        assert row["rollout/logprob_diff/max_abs"] < 1e-3  # the pushed weights are the ones that sampled

    turns = received_turns((tmp_path / "sglang" / "server0.log").read_text())
    launch = "G" + "R"  # SGLang's own warm-up request; the servers start in a generation turn, released at its end
    first_handoff_and_validation = "T" + "UGR"  # the servers held their weights: pushed without a resume
    step = "UGR" + "R" + "UT" + "UGR"  # rollouts; weights released; resumed and filled; validation
    assert turns == launch + first_handoff_and_validation + step * 2, turns
