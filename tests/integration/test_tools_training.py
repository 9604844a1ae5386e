"""The tool demo's path end to end (examples/tiny_cpu_tools.yaml, shrunk): a tiny model warm-started on traces that
call the python tool, then DAPO steps whose every response is a multi-turn rollout through the real bubblewrap
sandbox.

* the run trains (parameters move) and makes real calls (``tools/calls`` > 0 every step), and the tool-output tokens
  of its responses carry loss mask 0: exactly the output blocks the loop appended; the control, the same run with
  tools off (the no-tool twin), makes no call and has no mask;
* SIGKILL after the step-2 checkpoint, then ``--resume``: the metrics of the uninterrupted run, tool counts
  included. Besides the clock readings (``timing_s/tool_calls`` among them), the sandbox's timing reaches one thing:
  a trajectory's next turn joins the engine's batch when its call returns, and the embedded engine's log-probs
  differ in float rounding with what shares their batch (measured: ~1e-10 on ``rollout/logprob_diff/mean_abs`` of
  ~3e-7, between two uninterrupted runs). So the metrics computed from the engine's log-probs are compared to 1e-6;
  the sampled tokens, rewards, tool counts, losses and weights (every other metric) exactly.

A reward that splits every group (by response length parity) makes every step train, whatever the barely
warm-started model gets right. One warm-started model serves every run: copied in as the run's ``initial_model``
(a complete folder is reused), so the runs keep ``model.source: tiny`` and its tokenizer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_runs import check_run, cli_command, kill_after_checkpoint, read_run_metrics
from spawn_ranks import run_distributed

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_cpu_tools.yaml"
SMALL = ["data.synthetic.num_train=600", "data.synthetic.num_heldout=8"]
# ~30 s: enough for the example's model to write calls (```python\nprint(664*773)\n```\n), not yet to copy well
WARM_START = ["warm_start.max_steps=80", "warm_start.batch_size=64", "warm_start.eval_every=80",
              "warm_start.stop_at_accuracy=1.0"]
RUN = ["warm_start.enabled=false", "rollout.n_samples=4", "trainer.train_batch_size=2", "trainer.mini_batch_size=1",
       "algorithm.dynamic_sampling=false", "algorithm.overlong_filtering=false", "trainer.total_steps=4",
       "trainer.save_every=2", "eval.every=2", "optim.lr=1e-3"]
ENGINE_LOGPROBS = ("rollout/logprob_diff/", "rollout_corr/", "rollout/gen_prob/")  # see the module docstring
PARITY = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return 1.0 if len(solution_str) % 2 else -1.0\n"


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory) -> Path:
    """The warm-started model (its folder, complete), made once."""
    out = tmp_path_factory.mktemp("tools_model") / "model"
    check_run("prepare-tiny", str(EXAMPLE), *SMALL, *WARM_START, "--out", str(out))
    return out


def _run_args(run_dir: Path, warm_model: Path, reward: Path, *extra: str) -> list[str]:
    shutil.copytree(warm_model, run_dir / "initial_model", dirs_exist_ok=True)
    return [*SMALL, *RUN, f"reward.function={reward}", f"trainer.run_dir={run_dir}", *extra]


def collect_after_training(overrides: list[str]) -> dict:
    """Train, then collect one more step's groups: what the last step's responses and masks look like."""
    import torch
    from trainer_harness import build_trainer

    from dapo_megatron.metrics.writer import read_metrics

    trainer = build_trainer(overrides, EXAMPLE)
    before = {n: p.detach().clone() for n, p in trainer.actor.model.named_parameters()}
    try:
        trainer.run()
        moved = sum(not torch.equal(before[n], p.detach()) for n, p in trainer.actor.model.named_parameters())
        groups, _ = trainer.collector.collect(trainer.config.trainer.total_steps)
        decode = trainer.tokenizer.decode
        responses = []
        for group in groups:
            for i, ids in enumerate(group.responses):
                ids = [int(t) for t in ids]
                mask = None if group.loss_masks is None else [int(m) for m in group.loss_masks[i]]
                responses.append({"text": decode(ids), "calls": group.tool_use[i].calls if group.tool_use else 0,
                                  "sampled": decode([t for t, m in zip(ids, mask or [1] * len(ids)) if m]),
                                  "tool": "" if mask is None else decode([t for t, m in zip(ids, mask) if not m]),
                                  "mask": mask, "finish": group.finish_reasons[i]})
    finally:
        trainer.shutdown()
    return {"moved": moved, "responses": responses, "metrics": read_metrics(trainer.run_dir)}


def test_a_tools_run_trains_calls_the_sandbox_and_masks_tool_output(tmp_path, warm_model):
    reward = tmp_path / "parity.py"
    reward.write_text(PARITY)
    [result] = run_distributed(collect_after_training, 1, _run_args(tmp_path / "tools", warm_model, reward),
                               timeout_s=900)
    steps = [row for row in result["metrics"] if row["step"] > 0]
    assert result["moved"] > 0 and all(row["actor/num_updates"] > 0 for row in steps)
    assert all(row["tools/calls"] > 0 and row["tools/python/calls"] == row["tools/calls"] for row in steps)
    assert all(row["tools/output_tokens/mean"] > 0 for row in steps)
    validations = [row for row in result["metrics"] if "val/all/acc/mean@1" in row]
    assert [row["step"] for row in validations] == [0, 2, 4]
    assert all(row["val/tools/calls_per_response"] > 0 for row in validations)  # validation calls the tool too
    called = [r for r in result["responses"] if r["calls"]]
    assert called
    for response in result["responses"]:
        blocks = response["text"].count("```output\n")
        assert blocks == response["calls"]  # an output block for every call the loop ran, none written by the model
        assert "```output\n" not in response["sampled"]  # what was sampled (mask 1) holds no tool output ...
        # ... and what carries mask 0 is exactly the output blocks, each "```output\n<what the code printed>\n```\n"
        # (the last one cut when the response ran out of room)
        assert response["tool"].count("```output\n") == blocks
        assert response["tool"].startswith("```output\n") or not blocks
        closed = response["tool"].count("\n```\n")
        assert closed == blocks or (response["finish"] == "length" and closed == blocks - 1)
    # control: the same run without tools (the no-tool twin) makes no call and has no mask
    [plain] = run_distributed(collect_after_training, 1,
                              _run_args(tmp_path / "plain", warm_model, reward, "rollout.tools.enabled=false"),
                              timeout_s=900)
    assert not any(key.startswith("tools/") for row in plain["metrics"] for key in row)
    assert all(r["mask"] is None and r["calls"] == 0 for r in plain["responses"])
    assert any("```python\n" in r["text"] for r in plain["responses"])  # it still writes calls: nothing answers


def test_sigkill_then_resume_is_exact_with_tools_on(tmp_path, warm_model):
    reward = tmp_path / "parity.py"
    reward.write_text(PARITY)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    check_run("train", str(EXAMPLE), *_run_args(straight, warm_model, reward), timeout=900)
    kill_after_checkpoint(cli_command("train", str(EXAMPLE), *_run_args(killed, warm_model, reward)), killed, step=2)
    assert not (killed / "checkpoints" / "step_000004").exists()
    check_run("train", str(EXAMPLE), *_run_args(killed, warm_model, reward), "--resume", timeout=900)
    expected, resumed = read_run_metrics(straight), read_run_metrics(killed)
    assert [row["step"] for row in resumed] == [0, 1, 2, 3, 4]
    assert all(row["tools/calls"] > 0 for row in expected if row["step"] > 0)  # the tools really ran
    exact = [{k: v for k, v in row.items() if not k.startswith(ENGINE_LOGPROBS)} for row in expected]
    assert [{k: v for k, v in row.items() if not k.startswith(ENGINE_LOGPROBS)} for row in resumed] == exact
    for want, got in zip(expected, resumed):
        close = {k: v for k, v in want.items() if k.startswith(ENGINE_LOGPROBS)}
        assert set(close) == {k for k in got if k.startswith(ENGINE_LOGPROBS)}
        assert got == pytest.approx(want, rel=0, abs=1e-6)
