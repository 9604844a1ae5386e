"""The DAPO trainer: the pieces of one step, and short end-to-end runs with the real megatron-core policy and the
embedded engine (fast set) on the synthetic task."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from trainer_harness import run_trainer

from dapo_megatron.config import load_config
from dapo_megatron.rollout.engine import Sample
from dapo_megatron.metrics.writer import read_metrics
from dapo_megatron.trainer.policy_update import PolicyUpdate
from dapo_megatron.reward.scorer import RewardScorer
from dapo_megatron.collectors.group import RolloutGroup, generation_seed, score_groups

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny_cpu.yaml"


def _group(scores, accs, reasons, lengths=None):
    lengths = lengths or [3] * len(scores)
    return RolloutGroup(prompt_ids=[5, 6], ground_truth="1", data_source="t",
                        responses=[[7] * n for n in lengths], engine_logprobs=[[-1.0] * n for n in lengths],
                        finish_reasons=reasons, accs=accs, scores=scores, overlong_penalties=[0.0] * len(scores),
                        weight_version=0)


def test_training_samples_advantages_and_overlong_filtering():
    config = load_config(TINY, ["rollout.n_samples=4"])
    group = _group([1.0, -1.0, -1.0, 1.0], [True, False, False, True], ["stop", "length", "stop", "stop"])
    samples = PolicyUpdate(None, config).training_samples([group])  # steps 5 needs no actor
    advantages = [float(s.advantage) for s in samples]
    expected = (torch.tensor([1.0, -1, -1, 1]) - 0) / (torch.tensor([1.0, -1, -1, 1]).std() + 1e-6)
    assert advantages == pytest.approx(expected.tolist())
    assert samples[1].num_loss_tokens == 0  # truncated: masked out of the loss
    assert [s.num_loss_tokens for s in samples] == [3, 0, 3, 3]
    unfiltered = PolicyUpdate(None, load_config(TINY, ["rollout.n_samples=4", "algorithm.overlong_filtering=false"])
                              ).training_samples([group])
    assert [s.num_loss_tokens for s in unfiltered] == [3, 3, 3, 3]


def test_soft_overlong_punishment_switch_changes_scores():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "Answer: 1"

    from dapo_megatron.data.prompts import PromptRecord

    record = PromptRecord(prompt_ids=(1, 2), ground_truth="1", data_source="t", index=0, text="")
    samples = [Sample(0, [3] * n, [-0.1] * n, "stop") for n in (10, 44, 48)]
    on_config, off_config = load_config(TINY), load_config(TINY, ["algorithm.overlong_penalty=false"])
    (on,) = score_groups([(record, samples)], Tok(), on_config, RewardScorer(on_config), step=0)
    (off,) = score_groups([(record, samples)], Tok(), off_config, RewardScorer(off_config), step=0)
    # max_response_length 48, buffer 8: no penalty up to 40 tokens, linear to -1 at 48
    assert on.scores == pytest.approx([1.0, 0.5, 0.0])
    assert off.scores == [1.0, 1.0, 1.0]
    assert on.accs == off.accs == [True, True, True]  # the filter's input ignores the penalty


def test_mini_batches_are_a_seeded_partition():
    config = load_config(TINY, ["trainer.train_batch_size=8", "trainer.mini_batch_size=2", "rollout.n_samples=2"])
    group = _group([1.0, -1.0], [True, False], ["stop", "stop"])
    stage = PolicyUpdate(None, config)
    samples = stage.training_samples([group] * 8)
    first = stage.mini_batch_indices(len(samples), step=3)
    again = stage.mini_batch_indices(len(samples), step=3)
    other = stage.mini_batch_indices(len(samples), step=4)
    assert len(first) == 4 and all(len(mb) == 4 for mb in first)
    assert first == again
    assert first != other
    assert sorted(i for mb in first for i in mb) == list(range(len(samples)))


def test_generation_seeds_differ_by_step_and_round():
    seeds = {generation_seed(0, step, r) for step in range(50) for r in range(10)}
    assert len(seeds) == 500


# ------------------------------------------------------------------------------------------- end to end

def _tiny_overrides(run_dir: Path, *extra: str) -> list[str]:
    return [f"trainer.run_dir={run_dir}", "warm_start.enabled=false", "trainer.total_steps=2",
            "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
            "data.synthetic.num_train=200", "data.synthetic.num_heldout=8", "eval.every=0",
            "trainer.save_every=1", "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4",
            "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64", *extra]


def test_two_dapo_steps_update_the_policy_and_the_engine(tmp_path):
    from spawn_ranks import run_distributed

    # A random model is never right, so with dynamic sampling every group would be filtered out; this run trains on
    # every group (the ablation switch) to exercise the update path.
    (result,) = run_distributed(run_trainer, 1, _tiny_overrides(tmp_path, "algorithm.dynamic_sampling=false"))
    assert result["changed"] == result["num_params"] and not result["padding_moved"]  # every parameter moved
    assert result["version"] == 2  # the engine serves the weights of the last update
    rows = result["metrics"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "critic/score/mean",
                    "response_length/mean", "response_length/clip_ratio", "train/num_gen_batches",
                    "actor/pg_clipfrac", "actor/ppo_kl", "rollout/logprob_diff/max_abs", "timing_s/step"):
            assert math.isfinite(row[key]), (key, row[key])
        assert row["actor/num_updates"] == 2 and row["actor/lr"] > 0
        assert row["rollout/weight_version"] == row["step"]
        assert row["rollout/logprob_diff/max_abs"] < 1e-3  # engine and policy agree on what was sampled
    assert "val/all/acc/mean@1" in rows[0] and "val/all/acc/mean@1" in rows[-1]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints" / "step_000002" / "COMPLETE").exists()
    hf_side_files = {p.name for p in (tmp_path / "checkpoints" / "step_000002" / "hf").iterdir()}
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= hf_side_files  # what an HF export needs
    assert (tmp_path / "config.yaml").exists()


def test_generation_round_cap_trains_on_what_was_collected(tmp_path):
    from spawn_ranks import run_distributed

    # Random model: every group is all-wrong, so dynamic sampling keeps none; the step must stop at the cap,
    # say so, and not crash.
    (result,) = run_distributed(run_trainer, 1, _tiny_overrides(
        tmp_path, "algorithm.dynamic_sampling=true", "algorithm.max_gen_rounds=2", "algorithm.gen_batch_size=4",
        "trainer.total_steps=1"))
    (row,) = result["metrics"][1:]
    assert row["train/hit_gen_round_cap"] == 1.0
    assert row["train/num_gen_batches"] == 2
    assert row["train/filter/all_wrong_fraction"] == 1.0
    assert row["train/num_groups"] == 0 and row["train/skipped_empty_batch"] == 1.0
    assert result["changed"] == 0


# ------------------------------------------------------------------------------------------- ablation switches

LADDER = sorted((REPO / "examples" / "ablation").glob("*.yaml"))


def test_each_ablation_rung_changes_exactly_its_switch():
    """Rung k differs from rung k-1 in one algorithm field (plus its run_dir); rung 5 is the full DAPO config."""
    from dapo_megatron.config import config_to_dict

    rungs = [load_config(path) for path in LADDER]
    assert [p.stem.split("_", 1)[0] for p in LADDER] == ["0", "1", "2", "3", "4", "5"]
    claimed = [None, {"overlong_filtering"}, {"eps_high"}, {"overlong_penalty"}, {"loss_agg"}, {"dynamic_sampling"}]
    for k in range(1, len(rungs)):
        before, after = config_to_dict(rungs[k - 1]), config_to_dict(rungs[k])  # the objective's own filled in
        changed = {key for key in before["algorithm"] if before["algorithm"][key] != after["algorithm"][key]}
        assert changed == claimed[k], (LADDER[k].name, changed)
        before.pop("algorithm"), after.pop("algorithm")
        before["trainer"].pop("run_dir"), after["trainer"].pop("run_dir")
        assert before == after, LADDER[k].name
    assert config_to_dict(rungs[-1])["algorithm"] == config_to_dict(load_config(TINY))["algorithm"]


def test_ablation_switches_reach_the_buffer():
    from dapo_megatron.collectors.sync import RolloutCollector

    grpo, dapo = load_config(LADDER[0]), load_config(TINY)

    class Sampler:
        def __init__(self):
            self.asked = []

        def next_batch(self, size):
            self.asked.append(size)
            return []

    for config, filters, per_round in ((grpo, False, grpo.trainer.train_batch_size),
                                       (dapo, True, dapo.algorithm.gen_batch_size)):
        sampler = Sampler()
        collector = RolloutCollector(engine=None, sampler=sampler, tokenizer=None, config=config,
                                     reward=RewardScorer(config))
        assert collector.buffer.filter_groups is filters
        collector.engine = type("E", (), {"generate": lambda self, prompts, params: []})()
        collector.tokenizer = type("T", (), {"eos_token_id": 1})()
        collector.collect(step=0)
        assert sampler.asked[0] == per_round


# ------------------------------------------------------------------------------------------- eval and plot CLIs

def test_plot_writes_a_png(tmp_path):
    import json
    import subprocess
    import sys

    from dapo_megatron.metrics.plot import panel_series

    rows = [{"step": s, "critic/score/mean": -1 + s / 10, "rollout/acc/mean": s / 20, "actor/entropy": 0.5 - s / 50,
             "response_length/mean": 20 + s, "val/all/acc/mean@1": s / 25, "rollout/gen_prob/mean": 0.8 + s / 100,
             "response/reflection_rate": s / 40} for s in range(8)]
    panels = {title: [key for key, _ in curves] for title, curves in panel_series(rows).items()}
    assert panels == {"response length": ["response_length/mean"], "reward": ["critic/score/mean"],
                      "entropy": ["actor/entropy"], "generation probability": ["rollout/gen_prob/mean"],
                      "reflection rate": ["response/reflection_rate"],
                      "accuracy": ["rollout/acc/mean", "val/all/acc/mean@1"]}  # the paper's four + reflection
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, "-m", "dapo_megatron.cli", "plot", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    png = tmp_path / "curves.png"
    assert str(png) in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _train_then_reload_the_checkpoint(overrides: list[str]) -> dict:
    """Train, then serve the last checkpoint through eval's loader (no optimizer, no DDP) and sample the validation
    prompts from it, from the engine the run ended with, and (the control) from the run's initial weights."""
    import tempfile

    from trainer_harness import build_trainer

    from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
    from dapo_megatron.rollout.engine import SamplingParams
    from dapo_megatron.trainer.evaluate import checkpoint_engine

    trainer = build_trainer(overrides)
    try:
        trainer.run()
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7,
                                stop_token_ids=(trainer.tokenizer.eos_token_id,))
        prompts = [r.prompt_ids for r in trainer.eval_prompts]

        def sampled(engine):
            return [(s.token_ids, s.logprobs) for samples in engine.generate(prompts, params) for s in samples]

        with tempfile.TemporaryDirectory() as scratch:
            reloaded = checkpoint_engine(trainer.config, trainer.ckpt_dir / "step_000002", scratch, trainer.backend)
            initial = EmbeddedEngine.from_hf_directory(trainer.model_dir)
            return {"served": sampled(trainer.engine), "reloaded": sampled(reloaded), "initial": sampled(initial)}
    finally:
        trainer.shutdown()


def test_eval_reproduces_the_run_and_writes_nothing_into_it(tmp_path):
    import json
    import subprocess
    import sys

    from spawn_ranks import run_distributed

    run_dir = tmp_path / "run"
    # Two steps: in the first, the random model's groups may all score alike (zero advantages: no update).
    overrides = _tiny_overrides(run_dir, "algorithm.dynamic_sampling=false", "trainer.total_steps=2")
    (engines,) = run_distributed(_train_then_reload_the_checkpoint, 1, overrides)
    assert engines["reloaded"] == engines["served"]  # the same weights: same tokens, same log-probs
    assert engines["initial"] != engines["served"]  # control: the comparison tells weights apart

    logged = {k: v for k, v in read_metrics(run_dir)[-1].items() if k.startswith("val/")}
    before = _files(run_dir)
    out = tmp_path / "eval.json"
    # A config that differs from the run's in a setting eval does not use: the run's config.yaml must not change.
    result = subprocess.run([sys.executable, "-m", "dapo_megatron.cli", "eval", str(TINY), *overrides,
                             "trainer.total_steps=9", "--ckpt", str(run_dir / "checkpoints" / "step_000002"),
                             "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    scores = json.loads(out.read_text())
    assert set(scores) >= {"val/all/acc/mean@1", "val/synthetic-arith/acc/mean@1"}
    assert scores == logged  # the numbers the training run logged for this checkpoint
    printed = dict(line.split(": ") for line in result.stdout.splitlines() if line.startswith("val/"))
    assert {k: float(v) for k, v in printed.items()} == pytest.approx(logged, abs=5e-5)
    assert _files(run_dir) == before  # config.yaml byte for byte, and no file added, removed or changed
