"""bench/ablation.py: the pure parts on synthetic metrics files (aggregation over seeds, steps-to-target, the tables,
resume detection, flag checks), and one slow end-to-end run of the real CLI at a tiny budget."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ablation  # bench/ is on sys.path (pyproject.toml's pytest `pythonpath`)
import ablation_dynamics as dynamics
import ablation_report as report
from dapo_megatron.data.synthetic import make_split
from dapo_megatron.data.synthetic_scratchpad import ScratchpadTaskConfig, make_scratchpad_split

REPO = Path(__file__).resolve().parents[2]

ACC = "val/all/acc/mean@1"


def _write_metrics(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _run(seed: int, accs: dict[int, float], *, samples: float = 256.0, kept: float = 1.0, no_signal=(0.1, 0.2),
         entropy_end: float = 0.1, steps: int = 4) -> report.SeedRun:
    """A synthetic run: accuracy evaluated at ``accs``' steps, ``samples`` generated per step."""
    rows = []
    for step in range(steps + 1):
        row = {"step": step}
        if step:
            row.update({report.SAMPLES: samples, report.KEPT: kept, report.ALL_CORRECT: no_signal[0],
                        report.ALL_WRONG: no_signal[1], report.LENGTH: 20.0 + step, report.TRUNCATED: 0.01 * step,
                        report.ENTROPY: entropy_end if step == steps else 1.0, report.STEP_SECONDS: 2.0})
        if step in accs:
            row[ACC] = accs[step]
        rows.append(row)
    return report.SeedRun(seed, rows)


# ------------------------------------------------------------------------------------------------ reading metrics


def test_read_rows_keeps_the_last_row_of_a_step_logged_twice(tmp_path):
    path = _write_metrics(tmp_path / "metrics.jsonl", [{"step": 0, ACC: 0.1}, {"step": 1, "x": 1.0},
                                                       {"step": 0, ACC: 0.2}, {"step": 1, "x": 2.0}])
    assert report.read_rows(path) == [{"step": 0, ACC: 0.2}, {"step": 1, "x": 2.0}]


def test_read_rows_names_the_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1,\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        report.read_rows(path)
    path.write_text('{"step": "one"}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: .*integer 'step'"):
        report.read_rows(path)


def test_seed_run_curves_and_weighted_means():
    run = report.SeedRun(0, [
        {"step": 0, ACC: 0.3},
        {"step": 1, report.SAMPLES: 100.0, report.KEPT: 0.5, report.ALL_CORRECT: 0.1, report.ALL_WRONG: 0.4},
        {"step": 2, report.SAMPLES: 300.0, report.KEPT: 0.9, report.ALL_CORRECT: 0.0, report.ALL_WRONG: 0.1,
         ACC: 0.4},
        {"step": 3, report.SAMPLES: 0.0, report.KEPT: 0.0, ACC: "nan"},  # the buffer was full: nothing generated
    ])
    assert run.accuracy() == {0: 0.3, 2: 0.4}  # a non-finite value is no evaluation
    assert run.cumulative_samples() == {0: 0.0, 1: 100.0, 2: 400.0, 3: 400.0}
    assert run.mean_over_steps(report.KEPT, report.SAMPLES) == pytest.approx((0.5 * 100 + 0.9 * 300) / 400)
    assert run.mean_over_steps(report.SAMPLES) == pytest.approx(400 / 3)
    assert run.no_signal_fraction() == pytest.approx((0.5 * 100 + 0.1 * 300) / 400)
    assert run.last(report.ENTROPY) is None


# ------------------------------------------------------------------------------------------------ aggregation


def test_summarize_rung_over_seeds():
    runs = [_run(0, {0: 0.4, 2: 0.5, 4: 0.6}, samples=256, kept=0.5),
            _run(1, {0: 0.4, 2: 0.7, 4: 0.8}, samples=512, kept=0.7, entropy_end=0.3),
            _run(2, {0: 0.4, 4: 0.7}, samples=256, kept=0.6, entropy_end=0.2)]
    s = report.summarize_rung("r", runs)
    assert sorted(s.acc) == [0, 4]  # only steps every seed evaluated
    assert s.acc[4].mean == pytest.approx(0.7) and s.acc[4].std == pytest.approx(0.1) and s.acc[4].n == 3
    assert s.acc[0].std == 0.0
    assert s.samples_at[4] == pytest.approx((1024 + 2048 + 1024) / 3)
    assert s.samples_per_step.mean == pytest.approx(1024 / 3)
    assert s.filtered.mean == pytest.approx(0.4)
    assert s.no_signal.mean == pytest.approx(0.3)
    assert s.entropy_end.mean == pytest.approx(0.2)
    assert s.response_length.mean == pytest.approx(22.5)
    assert s.truncated.mean == pytest.approx(0.025)
    assert s.final is s.acc[4]
    assert s.best() == (pytest.approx(0.7), 4)


def test_one_seed_has_no_std_and_best_prefers_the_earlier_step():
    s = report.summarize_rung("r", [_run(0, {0: 0.4, 2: 0.6, 4: 0.6})])
    assert s.acc[2].std is None and s.acc[2].format() == "0.600"
    assert s.best() == (0.6, 2)


def test_summarize_rung_refuses_runs_without_a_shared_evaluation():
    with pytest.raises(ValueError, match="share no evaluated step"):
        report.summarize_rung("r", [_run(0, {2: 0.5}), _run(1, {4: 0.5})])


def test_first_reaching():
    curve = {0: 0.3, 10: 0.45, 20: 0.5, 30: 0.4}
    assert report.first_reaching(curve, 0.45) == 10  # reaching counts, not only exceeding
    assert report.first_reaching(curve, 0.5) == 20
    assert report.first_reaching(curve, 0.51) is None
    assert report.first_reaching(curve, 0.0) == 0


def test_step_zero_spread_catches_runs_from_different_models():
    same = [_run(0, {0: 0.4, 2: 0.5}), _run(1, {0: 0.4, 2: 0.6})]
    assert report.step_zero_spread(same) == 0.0
    assert report.step_zero_spread([*same, _run(2, {0: 0.43})]) == pytest.approx(0.03)
    assert report.step_zero_spread([_run(0, {2: 0.5})]) is None


@pytest.mark.parametrize("steps,every,expected", [(60, 5, [0, 20, 40, 60]), (60, 20, [0, 20, 40, 60]),
                                                  (60, 25, [0, 25, 50, 60]), (2, 1, [0, 1, 2]), (60, 0, [0, 60]),
                                                  (7, 5, [0, 5, 7])])
def test_default_table_steps_are_evaluated_steps(steps, every, expected):
    assert report.default_table_steps(steps, every) == expected


# ------------------------------------------------------------------------------------------------ tables


def _ladder():
    grpo = report.summarize_rung("0_naive_grpo", [_run(0, {0: 0.4, 2: 0.42, 4: 0.5}),
                                                  _run(1, {0: 0.4, 2: 0.44, 4: 0.5})])
    dapo = report.summarize_rung("5_dynamic_sampling", [
        _run(0, {0: 0.4, 2: 0.5, 4: 0.6}, samples=384, kept=0.6),
        _run(1, {0: 0.4, 2: 0.52, 4: 0.64}, samples=512, kept=0.6)])
    flat = report.summarize_rung("1_overlong_filtering", [_run(0, {0: 0.4, 2: 0.4, 4: 0.45}),
                                                          _run(1, {0: 0.4, 2: 0.4, 4: 0.45})])
    return grpo, flat, dapo


def _table_rows(markdown: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in markdown.splitlines()
            if line.startswith(f"| {first_cell}")]


def test_tables_measure_against_rung_zero():
    grpo, flat, dapo = _ladder()
    text = report.format_tables([grpo, flat, dapo], [0, 2, 4], baseline=grpo)
    (acc_header, eff_header) = _table_rows(text, "rung")
    assert acc_header == ["rung", "seeds", "acc @0", "acc @2", "acc @4", "best (step)", "final − rung 0"]
    assert eff_header[:3] == ["rung", "steps to 0.500", "samples to 0.500"]
    grpo_acc, grpo_eff = _table_rows(text, "0_naive_grpo")
    dapo_acc, dapo_eff = _table_rows(text, "5_dynamic_sampling")
    flat_acc, flat_eff = _table_rows(text, "1_overlong_filtering")
    assert grpo_acc[2:6] == ["0.400 ± 0.000", "0.430 ± 0.014", "0.500 ± 0.000", "0.500 (4)"]
    assert grpo_acc[6] == "—"
    # +0.12 over standard error sqrt(0.0283²/2 + 0) = 0.02: 6.0 SE
    assert dapo_acc[6] == "+0.120 (+6.0 SE)"
    assert dapo_eff[1:4] == ["2", "896", "448 ± 91 (×1.75)"]  # mean of 2×384 and 2×512 generated by step 2
    assert grpo_eff[1:4] == ["4", "1,024", "256 ± 0 (×1.00)"]
    assert flat_eff[1:3] == ["not reached", "—"]
    assert dapo_eff[4:8] == ["22.5 ± 0.0", "0.025 ± 0.000", "0.100 ± 0.000", "0.40 ± 0.00"]
    assert flat_acc[6] == "-0.050"  # both stds are 0: no standard error to divide by


def test_tables_without_rung_zero_leave_out_the_comparisons():
    _, flat, dapo = _ladder()
    text = report.format_tables([flat, dapo], [0, 4], baseline=None)
    acc_header, eff_header = _table_rows(text, "rung")
    assert "final − rung 0" not in acc_header
    assert not any(h.startswith(("steps to", "samples to")) for h in eff_header)
    assert _table_rows(text, "5_dynamic_sampling")[1][1] == "448 ± 91"  # no ratio without a baseline


def test_plot_writes_a_png(tmp_path):
    grpo, flat, dapo = _ladder()
    out = report.plot_curves([grpo, flat, dapo], tmp_path / "curves.png", target=grpo.final.mean)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def _dynamics_run(seed: int, *, entropy: list[float], truncated: list[float], length: float = 30.0) -> report.SeedRun:
    rows = [{"step": 0, ACC: 0.4}]
    for step, (h, t) in enumerate(zip(entropy, truncated), 1):
        rows.append({"step": step, report.ENTROPY: h, report.TRUNCATED: t, report.LENGTH: length,
                     report.CLIPFRAC: 0.01, report.CLIPFRAC_HIGH: 0.002 * (seed + 1),
                     **({ACC: 0.5} if step == len(entropy) else {})})
    return report.SeedRun(seed, rows)


def test_start_and_late_means_and_the_dynamics_table():
    run = _dynamics_run(0, entropy=[1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], truncated=[0.4] * 5 + [0.0] * 3)
    assert run.mean_of_steps(report.TRUNCATED, first=5) == pytest.approx(0.4)
    assert run.mean_of_steps(report.ENTROPY, last_fraction=0.25) == pytest.approx(0.35)  # the last 2 of 8 steps
    s = report.summarize_rung("2_clip_higher", [run, _dynamics_run(1, entropy=[0.5] * 8, truncated=[0.2] * 8)])
    assert s.truncated_start.mean == pytest.approx(0.3) and s.truncated.mean == pytest.approx((0.25 + 0.2) / 2)
    assert s.dynamics[report.ENTROPY][1].mean == pytest.approx(0.75) and s.dynamics[report.ENTROPY][1].n == 2
    header, row = _table_rows(dynamics.format_dynamics_table([s]), "rung")[0], _table_rows(
        dynamics.format_dynamics_table([s]), "2_clip_higher")[0]
    assert header[1:3] == ["truncated (first 5 steps)", "truncated (run)"]
    assert row[1:3] == ["0.300 ± 0.141", "0.225 ± 0.035"]
    assert row[-2:] == ["0.0100 ± 0.0000", "0.0030 ± 0.0014"]  # clipped tokens, of them at the upper bound
    # Control: a run that never truncates shows 0 in both truncation columns.
    flat = report.summarize_rung("0_naive_grpo", [_dynamics_run(0, entropy=[0.5] * 8, truncated=[0.0] * 8)])
    assert _table_rows(dynamics.format_dynamics_table([flat]), "0_naive_grpo")[0][1:3] == ["0.000", "0.000"]


def _rung(name: str, entropies: list[float], acc: float = 0.5) -> report.RungSummary:
    return report.summarize_rung(name, [
        report.SeedRun(k, [{"step": 0, ACC: 0.4}, *({"step": t, report.ENTROPY: h, report.TRUNCATED: 0.1,
                                                       report.LENGTH: 30.0} for t in range(1, 5)),
                           {"step": 4, ACC: acc + 0.01 * k, report.ENTROPY: h, report.TRUNCATED: 0.1,
                            report.LENGTH: 30.0}])
        for k, h in enumerate(entropies)])


def test_technique_verdicts_say_whether_a_difference_exceeds_seed_noise():
    symmetric = _rung("1_overlong_filtering", [0.30, 0.32, 0.31])
    higher = _rung("2_clip_higher", [0.50, 0.52, 0.51])
    text = dynamics.technique_verdicts([_rung("0_naive_grpo", [0.3, 0.3, 0.31]), symmetric, higher])
    clip = next(line for line in text.splitlines() if line.startswith("- **Clip-Higher**"))
    assert "**exceeds seed noise** on entropy (last quarter)" in clip
    assert "entropy (last quarter) 0.510 vs 0.310, +0.200 (+24.5 SE)" in clip
    assert "final accuracy 0.510 vs 0.510, +0.000 (+0.0 SE)" in clip
    assert "overlong filtering" in text and "dynamic sampling" not in text  # only techniques whose rungs ran
    # Control: the same entropy with and without Clip-Higher is within seed noise.
    same = dynamics.technique_verdicts([symmetric, _rung("2_clip_higher", [0.31, 0.30, 0.32])])
    assert "within seed noise on entropy (last quarter)" in same and "exceeds" not in same


def test_dynamics_plot_writes_a_png(tmp_path):
    runs = [_dynamics_run(k, entropy=[1.0 - 0.1 * t for t in range(8)], truncated=[0.2] * 8) for k in range(2)]
    summaries = [report.summarize_rung("0_naive_grpo", runs), report.summarize_rung("2_clip_higher", runs)]
    out = dynamics.plot_dynamics(summaries, tmp_path / "curves.png", symmetric_clip=["0_naive_grpo"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


# ------------------------------------------------------------------------------------------------ the driver


def test_run_state_and_its_control(tmp_path):
    run_dir = tmp_path / "seed0"
    assert ablation.run_state(run_dir) == "new"
    run_dir.mkdir()
    assert ablation.run_state(run_dir) == "new"  # an empty folder: nothing to resume
    (run_dir / "checkpoints").mkdir()
    assert ablation.run_state(run_dir) == "partial"
    _write_metrics(run_dir / "metrics.jsonl", [{"step": 0}])
    assert ablation.run_state(run_dir) == "partial"
    (run_dir / ablation.DONE_MARKER).write_text("{}\n")
    assert ablation.run_state(run_dir) == "done"
    (run_dir / ablation.DONE_MARKER).unlink()
    assert ablation.run_state(run_dir) == "partial"


def test_check_settings_records_then_insists(tmp_path):
    out = tmp_path / "out"
    settings = {"steps": 60, "eval_overrides": ["eval.every=5"], "overrides": []}
    ablation.check_settings(out, settings)
    ablation.check_settings(out, dict(settings))
    with pytest.raises(ablation.AblationError, match=r"made with steps=60, this call asks for 2"):
        ablation.check_settings(out, {**settings, "steps": 2})


def test_flags_are_checked():
    args = ablation.parse_args([])
    assert (args.seeds, args.steps, args.eval_every, args.table_steps) == (3, 60, 5, [0, 20, 40, 60])
    assert ablation.parse_args(["--table-steps", "0,15,60"]).table_steps == [0, 15, 60]
    for argv, message in ((["--set", "trainer.seed=3"], "trainer.seed is set by this tool"),
                          (["--set", "rollout.n_samples"], "expected dotted.key=value"),
                          (["--table-steps", "0,12"], r"steps \[12\] are not evaluated"),
                          (["--steps", "0"], "--steps must be >= 1")):
        with pytest.raises(ablation.AblationError, match=message):
            ablation.parse_args(argv)


def test_the_ladder_and_rung_selection():
    rungs = ablation.discover_rungs()
    assert [r.index for r in rungs] == [0, 1, 2, 3, 4, 5]
    assert [r.name for r in ablation.select_rungs(rungs, "5,0")] == ["0_naive_grpo", "5_dynamic_sampling"]
    with pytest.raises(ablation.AblationError, match=r"no rung \[7\]"):
        ablation.select_rungs(rungs, "0,7")


def test_the_scratchpad_ladder_has_gspo_and_cispo_rows_and_skips_its_base(tmp_path):
    rungs = ablation.discover_rungs(REPO / "examples" / "ablation" / "scratchpad")
    assert [r.name for r in rungs] == ["0_naive_grpo", "1_overlong_filtering", "2_clip_higher",
                                       "3_soft_overlong_punishment", "4_token_level_loss", "5_dynamic_sampling",
                                       "6_gspo", "7_cispo"]
    assert ablation.parse_args(["--ladder", "examples/ablation/scratchpad"]).ladder == rungs[0].config.parent
    with pytest.raises(ablation.AblationError, match="not a folder of rung configs"):
        ablation.parse_args(["--ladder", str(tmp_path / "missing")])
    # Control: a yaml that is neither base.yaml nor numbered is still refused.
    (tmp_path / "base.yaml").write_text("{}\n")
    (tmp_path / "0_a.yaml").write_text("{}\n")
    assert [r.name for r in ablation.discover_rungs(tmp_path)] == ["0_a"]
    (tmp_path / "extra.yaml").write_text("{}\n")
    with pytest.raises(ablation.AblationError, match="must start with its number"):
        ablation.discover_rungs(tmp_path)


def test_check_settings_tells_ladders_apart(tmp_path):
    settings = {"steps": 60, "eval_overrides": [], "overrides": []}
    old = tmp_path / "old"  # made before --ladder: its runs are the default ladder's
    ablation.check_settings(old, settings)
    ablation.check_settings(old, {**settings, "ladder": "examples/ablation"})
    with pytest.raises(ablation.AblationError, match=r"made with ladder='examples/ablation', this call asks for "
                                                     r"'examples/ablation/scratchpad'"):
        ablation.check_settings(old, {**settings, "ladder": "examples/ablation/scratchpad"})


def test_progress_counts_a_resumed_run_from_its_checkpoint(monkeypatch, capsys):
    clock = [100.0]
    monkeypatch.setattr(ablation.time, "monotonic", lambda: clock[0])
    progress = ablation.Progress(total_steps=30, finished_steps=10)  # one of three 10-step runs done earlier
    progress.start_run("run 2/3", 10)
    progress.on_step(8)  # the metrics of the interrupted invocation, before the trainer cuts them back
    progress.on_step(5)  # the checkpoint it resumed from
    clock[0] += 20.0
    progress.on_step(10)
    assert "ladder 20/30 steps | 4.0 s/step" in capsys.readouterr().out  # 20 s for the 5 steps trained here
    progress.finish_run(20.0)
    assert progress.trained_here == 5 and progress.finished_steps == 20


# ------------------------------------------------------------------------------------------------ end to end

TINY = ["trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
        "data.synthetic.num_train=200", "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4",
        "algorithm.gen_batch_size=6", "algorithm.max_gen_rounds=2", "model.tiny.hidden_size=32",
        "model.tiny.num_layers=2", "model.tiny.intermediate_size=64", "warm_start.max_steps=10",
        "warm_start.batch_size=16", "warm_start.eval_every=10"]


@pytest.mark.slow
def test_tiny_ladder_end_to_end_skips_finished_runs(tmp_path):
    out = tmp_path / "ladder"
    command = [sys.executable, str(REPO / "bench" / "ablation.py"), "--rungs", "0,5", "--seeds", "1", "--steps", "2",
               "--eval-every", "1", "--eval-problems", "8", "--out", str(out),
               *(arg for override in TINY for arg in ("--set", override))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def ladder() -> str:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout

    runs = {name: out / "runs" / name / "seed0" for name in ("0_naive_grpo", "5_dynamic_sampling")}

    def invocations(run_dir: Path) -> int:
        return (run_dir / "train.log").read_text().count("\n=== ")

    first = ladder()
    table = (out / "ablation.md").read_text()
    assert "every run's step-0 accuracy is identical" in table
    for name in runs:
        assert len(_table_rows(table, name)) == 3, name  # a row in the accuracy, efficiency and dynamics tables
        assert f"{name} seed 0: starting" in first
    assert "×1.00" in _table_rows(table, "0_naive_grpo")[1][3]
    assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(invocations(run_dir) == 1 for run_dir in runs.values())
    metrics_before = {name: (run_dir / "metrics.jsonl").read_bytes() for name, run_dir in runs.items()}

    second = ladder()
    assert second.count("finished earlier, skipped") == 2
    assert all(invocations(run_dir) == 1 for run_dir in runs.values())
    assert {name: (d / "metrics.jsonl").read_bytes() for name, d in runs.items()} == metrics_before

    # Control: without its marker a run counts as unfinished and is run again (resumed); the other is not.
    (runs["0_naive_grpo"] / ablation.DONE_MARKER).unlink()
    third = ladder()
    assert "0_naive_grpo seed 0: resuming" in third and third.count("finished earlier, skipped") == 1
    assert invocations(runs["0_naive_grpo"]) == 2 and invocations(runs["5_dynamic_sampling"]) == 1
    assert (runs["0_naive_grpo"] / ablation.DONE_MARKER).is_file()
    assert report.read_rows(runs["0_naive_grpo"] / "metrics.jsonl") == [
        json.loads(line) for line in metrics_before["0_naive_grpo"].decode().splitlines()]


@pytest.mark.slow
def test_scratchpad_ladder_end_to_end_reports_truncation_and_the_clip(tmp_path):
    out = tmp_path / "ladder"
    command = [sys.executable, str(REPO / "bench" / "ablation.py"), "--ladder", "examples/ablation/scratchpad",
               "--rungs", "1,2", "--seeds", "1", "--steps", "2", "--eval-every", "1", "--eval-problems", "4",
               "--out", str(out), *(arg for override in TINY for arg in ("--set", override))]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = (out / "ablation.md").read_text()
    assert (out / "ablation_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    heldout = [p.prompt_text for p in make_scratchpad_split(0, 200, 300, ScratchpadTaskConfig(2, 10)).heldout[:4]]
    assert heldout != [p.prompt_text for p in make_split(0, 200, 300).heldout[:4]]
    for name in ("1_overlong_filtering", "2_clip_higher"):
        run_dir = out / "runs" / name / "seed0"
        logged = [row[report.TRUNCATED] for row in report.read_rows(run_dir / "metrics.jsonl") if row["step"] > 0]
        row = _table_rows(table, name)[2]  # accuracy, efficiency, then the dynamics table
        assert row[2] == f"{sum(logged) / len(logged):.3f}"  # the table's truncation is the runs' metric
        assert float(row[2]) > 0  # 24 tokens cut most of a barely warm-started model's responses
        val = [json.loads(line) for line in (run_dir / "val_generations.jsonl").open() if '"step": 0' in line]
        val.sort(key=lambda g: g["index"])
        assert [g["prompt"] for g in val] == [f"<|user|>{h}<|assistant|>" for h in heldout]  # the scratchpad task
    # The config read back from each run: rung 1 has the symmetric clip, rung 2 (Clip-Higher) has not.
    assert dynamics.symmetric_clip(out / "runs" / "1_overlong_filtering" / "seed0")
    assert not dynamics.symmetric_clip(out / "runs" / "2_clip_higher" / "seed0")
    clip = next(line for line in table.splitlines() if line.startswith("- **Clip-Higher**"))
    assert "(2_clip_higher vs 1_overlong_filtering" in clip and "no SE: one seed" in clip


@pytest.mark.slow
def test_the_warm_start_trains_on_the_configured_task(tmp_path):
    """prepare-tiny's warm-start builds its prompts from data.synthetic.mode's problems: scratchpad prompts run to
    10-term chains (over 20 tokens), the default task's stay under 20."""

    def longest_warm_start_prompt(mode: str) -> int:
        result = subprocess.run(
            [sys.executable, "-m", "dapo_megatron.cli", "prepare-tiny", "examples/ablation/scratchpad/base.yaml",
             f"data.synthetic.mode={mode}", "data.synthetic.num_train=400", "warm_start.max_steps=1",
             "--out", str(tmp_path / mode)], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        lengths = re.findall(r"built 360 prompts \(longest (\d+) tokens\)", result.stdout + result.stderr)
        assert len(lengths) == 1, (result.stdout + result.stderr)[-3000:]  # the warm-start's 400 - 40 validation
        return int(lengths[0])

    assert longest_warm_start_prompt("scratchpad") > 20
    assert longest_warm_start_prompt("arith") < 20  # control: the default task's prompts
