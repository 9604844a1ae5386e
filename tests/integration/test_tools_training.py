"""The tool demo's path end to end (examples/tiny_cpu_tools.yaml, shrunk): a tiny model warm-started on traces that
call the python tool, then DAPO steps whose every response is a multi-turn rollout through the real bubblewrap
sandbox.

* the run trains (parameters move) and makes real calls, and the tool-output tokens of its responses carry loss
  mask 0: exactly the output blocks the loop appended; the control, the same run with tools off (the no-tool twin),
  makes no call and has no mask;
* SIGKILL after the step-2 checkpoint, then ``--resume``: the metrics of the uninterrupted run, tool counts
  included. Besides the clock readings (``timing_s/tool_calls`` among them), the sandbox's timing reaches one thing:
  a trajectory's next turn joins the engine's batch when its call returns, and the embedded engine's log-probs
  differ in float rounding with what shares their batch (measured between two uninterrupted runs: ~1e-10 on
  ``rollout/logprob_diff/mean_abs`` of ~3e-7; on a machine ~25 runnable processes deep, 1.3e-6 on the extremes,
  ``rollout/logprob_diff/max_abs`` of ~6e-6 and ``rollout_corr/ratio_max``/``ratio_min``, where one token's rounding
  is the whole value). So the metrics computed from the engine's log-probs are compared to 1e-6, their extremes to
  1e-5; the sampled tokens, rewards, tool counts, losses and weights (every other metric) exactly.

A reward that splits every group (by response length parity) makes every step train, whatever the barely
warm-started model gets right. One warm-started model serves every run: copied in as the run's ``initial_model``
(a complete folder is reused), so the runs keep ``model.source: tiny`` and its tokenizer.

No assertion needs one trajectory: which responses call the tool depends on float rounding, which differs by CPU and
thread count (two of these tests once saw a step of an AMD EPYC machine with no call), so calls, output blocks and
the control's unanswered calls are asserted over every response of the run, and the masks of every response.
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
              "warm_start.stop_at_accuracy=1.0", "warm_start.tool_trace_fraction=1.0"]  # every reference calls
RUN = ["warm_start.enabled=false", "rollout.n_samples=4", "trainer.train_batch_size=2", "trainer.mini_batch_size=1",
       "algorithm.dynamic_sampling=false", "algorithm.overlong_filtering=false", "trainer.total_steps=4",
       "trainer.save_every=2", "eval.every=2", "optim.lr=1e-3"]
ENGINE_LOGPROBS = ("rollout/logprob_diff/", "rollout_corr/", "rollout/gen_prob/")  # see the module docstring
EXTREMES = ("max_abs", "_max", "_min")  # one token's rounding is the whole value
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


def collect_after_training(overrides: list[str], check_stops: bool = False) -> dict:
    """Train, then collect one more step's groups: the responses (and masks) of every step of the run.
    ``check_stops``: also the first turns of the validation prompts, greedy, with and without the call's end as a
    stop of the engine."""
    import torch
    from trainer_harness import build_trainer

    from dapo_megatron.metrics.writer import read_metrics

    trainer = build_trainer(overrides, EXAMPLE)
    before = {n: p.detach().clone() for n, p in trainer.actor.model.named_parameters()}
    collected, collect = [], trainer.collector.collect

    def recording(step):
        groups, metrics = collect(step)
        collected.extend(groups)
        return groups, metrics

    trainer.collector.collect = recording
    try:
        trainer.run()
        moved = sum(not torch.equal(before[n], p.detach()) for n, p in trainer.actor.model.named_parameters())
        trainer.collector.collect(trainer.config.trainer.total_steps)
        stops = first_turns(trainer) if check_stops else None
        decode = trainer.tokenizer.decode
        responses = []
        for group in collected:
            for i, ids in enumerate(group.responses):
                ids = [int(t) for t in ids]
                mask = None if group.loss_masks is None else [int(m) for m in group.loss_masks[i]]
                responses.append({"text": decode(ids), "calls": group.tool_use[i].calls if group.tool_use else 0,
                                  "sampled": decode([t for t, m in zip(ids, mask or [1] * len(ids)) if m]),
                                  "tool": "" if mask is None else decode([t for t, m in zip(ids, mask) if not m]),
                                  "mask": mask, "finish": group.finish_reasons[i]})
    finally:
        trainer.shutdown()
    return {"moved": moved, "responses": responses, "metrics": read_metrics(trainer.run_dir), "stops": stops}


def first_turns(trainer) -> dict:
    """The engine's greedy first turn of each validation prompt and 24 training prompts with the call's end as a stop
    (as the rollout loop asks) and without: where each stopped, and where the call's end is in its text."""
    from dapo_megatron.rollout.engine import SamplingParams
    from dapo_megatron.tools import call_format

    calls = call_format(trainer.config.rollout.tools, trainer.tokenizer, ["python"])
    prompts = [record.prompt_ids for record in [*trainer.eval_prompts, *trainer.collector.sampler.next_batch(24)]]
    # room past a call's end: a turn is about 40 tokens, and at 40 a plain turn often hit its limit right at the end
    plain = SamplingParams(n=1, temperature=0.0, max_new_tokens=96, stop_token_ids=(trainer.tokenizer.eos_token_id,))
    stopped = SamplingParams(n=1, temperature=0.0, max_new_tokens=96, stop_token_ids=plain.stop_token_ids,
                             stop_sequences=(calls.end_ids,), stop_strings=(calls.end,))
    turns = {}
    for name, params in (("stopped", stopped), ("plain", plain)):
        turns[name] = [(len(s.token_ids), s.finish_reason, calls.call_end_length(prompt, s.token_ids))
                       for prompt, (s,) in zip(prompts, trainer.engine.generate(prompts, params))]
    return turns


def test_a_tools_run_trains_calls_the_sandbox_and_masks_tool_output(tmp_path, warm_model):
    reward = tmp_path / "parity.py"
    reward.write_text(PARITY)
    [result] = run_distributed(collect_after_training, 1, _run_args(tmp_path / "tools", warm_model, reward),
                               timeout_s=900)
    steps = [row for row in result["metrics"] if row["step"] > 0]
    assert result["moved"] > 0 and all(row["actor/num_updates"] > 0 for row in steps)
    # calls over the run (the python tool's are all of them), and each step's count is its responses' calls
    assert sum(row["tools/calls"] for row in steps) > 0
    assert all(row["tools/python/calls"] == row["tools/calls"] for row in steps)
    trained = result["responses"][:-8]  # the last collect's 8 responses were not trained
    assert sum(r["calls"] for r in trained) == sum(row["tools/calls"] for row in steps)
    validations = [row for row in result["metrics"] if "val/all/acc/mean@1" in row]
    assert [row["step"] for row in validations] == [0, 2, 4]
    assert sum(row["val/tools/calls_per_response"] for row in validations) > 0  # validation calls the tool too
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
    assert sum(row["tools/calls"] for row in expected if row["step"] > 0) > 0  # the tools really ran
    exact = [{k: v for k, v in row.items() if not k.startswith(ENGINE_LOGPROBS)} for row in expected]
    assert [{k: v for k, v in row.items() if not k.startswith(ENGINE_LOGPROBS)} for row in resumed] == exact
    for want, got in zip(expected, resumed):
        close = {k: v for k, v in want.items() if k.startswith(ENGINE_LOGPROBS)}
        assert set(close) == {k for k in got if k.startswith(ENGINE_LOGPROBS)}
        for key, value in close.items():
            assert got[key] == pytest.approx(value, rel=0, abs=1e-5 if key.endswith(EXTREMES) else 1e-6), key


@pytest.mark.sglang
def test_the_tools_demo_runs_a_step_on_a_cpu_sglang_server(tmp_path, warm_model):
    """The demo's model, tokenizer and tools on a real SGLang 0.5.23 server, a whole step and its handoff: the
    server loads the tiny tokenizer so that the call's end, a stop string, ends a turn where the rollout loop finds it
    (the loop would cut a turn that ran past it, which hides a stop that never matched: so the server's own turns
    are checked, against turns without the stop, which run past it). That the update moves the weights is
    test_a_tools_run_...'s (one step of 8 parity-scored responses may have nothing to learn)."""
    from trainer_harness import sglang_python

    reward = tmp_path / "parity.py"
    reward.write_text(PARITY)
    overrides = _run_args(tmp_path / "sglang", warm_model, reward, "rollout.engine=sglang",
                          f"rollout.sglang.python={sglang_python()}", "trainer.total_steps=1", "trainer.save_every=0",
                          "rollout.sglang.launch_timeout_s=600")
    [result] = run_distributed(collect_after_training, 1, overrides, True, timeout_s=1200)
    steps = [row for row in result["metrics"] if row["step"] > 0]
    assert [row["step"] for row in steps] == [1] and steps[0]["actor/num_updates"] > 0
    assert steps[0]["rollout/weight_version"] == 1
    assert steps[0]["tools/calls"] + sum(row["val/tools/calls_per_response"] for row in result["metrics"]) > 0
    for response in result["responses"]:
        assert response["text"].count("```output\n") == response["calls"] == response["tool"].count("```output\n")
    stopped, plain = result["stops"]["stopped"], result["stops"]["plain"]
    ended = [turn for turn in stopped if turn[2] is not None]
    assert ended and all(length == end and reason == "stop" for length, reason, end in ended)
    assert any(end is not None and length > end for length, _, end in plain)  # control: without it, past the end
