"""Where the curves go (metrics/loggers.py): metrics.jsonl plus TensorBoard, W&B (offline) and MLflow (a local
store) holding the same scalars, the validation generations file, and a missing logger library named at start."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_runs import REPO, TINY, cli_env
from logger_readers import mlflow_history, wandb_offline_history

from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.metrics.loggers import (
    IDS_FILE,
    build_loggers,
    check_logger_libraries,
    mlflow_metric_name,
    mlflow_tracking_uri,
)
from dapo_megatron.metrics.writer import MetricsWriter, read_metrics

ROWS = [(0, {"val/all/acc/mean@1": 0.25, "val/all/acc/best@1": 0.25}),
        (1, {"critic/score/mean": -0.5, "actor/entropy": 1.25, "actor/pg_loss": float("nan"), "reward/errors": 0.0}),
        (2, {"critic/score/mean": 0.125, "actor/entropy": 1.0, "actor/pg_loss": 0.5, "val/all/acc/mean@1": 0.5})]
GENERATIONS = [{"data_source": "t", "index": 3, "prompt": "4+3=", "response": "Answer: 7", "ground_truth": "7",
                "score": 1.0, "acc": True}]


def _write_run(run_dir: Path, *loggers: str, resume: bool = False) -> MetricsWriter:
    config = load_config(TINY, [f"trainer.run_dir={run_dir}", f"trainer.loggers=[{', '.join(loggers)}]",
                                "trainer.wandb.mode=offline"])
    run_dir.mkdir(parents=True, exist_ok=True)
    writer = MetricsWriter(run_dir, loggers=build_loggers(config, run_dir, resume=resume))
    for step, scalars in ROWS:
        if step != 1:
            writer.log_generations(step, GENERATIONS)
        writer.log(step, scalars)
    writer.close()
    return writer


def _finite_jsonl(run_dir: Path) -> dict[int, dict]:
    return {row.pop("step"): {k: v for k, v in row.items() if isinstance(v, float) and math.isfinite(v)}
            for row in read_metrics(run_dir)}


def test_tensorboard_and_the_generations_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write_run(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("actor/entropy")] == [(1, 1.25), (2, 1.0)]
    assert [e.step for e in events.Tensors("val/generations/text_summary")] == [0, 2]
    lines = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 2] and lines[0]["response"] == "Answer: 7"
    writer = MetricsWriter(tmp_path, loggers=build_loggers(load_config(TINY), tmp_path, resume=True))
    writer.truncate_after(1)  # a resume from step 1 forgets what the interrupted run logged after it
    assert [json.loads(line)["step"] for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()] == [0]
    writer.close()


def test_mlflow_names_are_what_mlflow_accepts():
    assert mlflow_metric_name("val/all/acc/mean@32") == "val/all/acc/mean_at_32"
    assert mlflow_metric_name("rollout/source/a+b/groups") == "rollout/source/a_b/groups"
    assert mlflow_metric_name("timing_s/step") == "timing_s/step"


@pytest.mark.parametrize("logger", ["wandb", "mlflow"])
def test_a_missing_logger_library_fails_at_start_naming_the_extra(tmp_path, logger):
    """The CLI as a user runs it, in a process where ``logger``'s library cannot be found (the test environment
    installs both extras: the import system is told the library is not there)."""
    hiding = tmp_path / f"cli_without_{logger}.py"
    hiding.write_text(textwrap.dedent(f"""
        import importlib.util, sys
        found = importlib.util.find_spec
        importlib.util.find_spec = (lambda name, *a, **k:
                                    None if name.split(".")[0] == {logger!r} else found(name, *a, **k))
        from dapo_megatron.cli import main
        sys.exit(main())
    """))
    args = ["train", str(TINY), f"trainer.run_dir={tmp_path / 'run'}", f"trainer.loggers=[tensorboard, {logger}]"]
    result = subprocess.run([sys.executable, str(hiding), *args], capture_output=True, text=True, cwd=REPO,
                            timeout=300, env=cli_env())
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"config error: trainer.loggers: {logger} needs {logger}" in result.stderr
    assert f"pip install -e '.[{logger}]' (in the dapo-megatron clone)" in result.stderr
    assert not (tmp_path / "run" / "initial_model").exists()  # before anything expensive
    # control: where the library is found (this environment), the same settings pass the check
    check_logger_libraries(load_config(TINY, [f"trainer.loggers=[tensorboard, {logger}]"]))


def test_wandb_offline_and_mlflow_hold_the_scalars_of_metrics_jsonl(tmp_path):
    _write_run(tmp_path, "tensorboard", "wandb", "mlflow")
    expected = _finite_jsonl(tmp_path)
    assert expected[1] == {"critic/score/mean": -0.5, "actor/entropy": 1.25, "reward/errors": 0.0}  # NaN left out
    wandb_rows = wandb_offline_history(tmp_path)
    assert {step: {k: v for k, v in row.items() if not k.startswith(("_", "val/generations/"))}
            for step, row in wandb_rows.items()} == expected
    assert wandb_rows[0]["val/generations/_type"] == "table-file" and wandb_rows[0]["val/generations/nrows"] == 1
    ids = json.loads((tmp_path / IDS_FILE).read_text())
    mlflow_rows = mlflow_history(f"sqlite:///{tmp_path / 'mlflow.db'}", ids["mlflow_run_id"])
    assert mlflow_rows == {step: {mlflow_metric_name(k): v for k, v in row.items()} for step, row in expected.items()}
    # --resume continues the same runs
    _write_run(tmp_path, "wandb", "mlflow", resume=True)
    assert json.loads((tmp_path / IDS_FILE).read_text()) == ids


def test_mlflow_tracking_uri_from_the_environment_is_honoured_unless_the_config_sets_one(tmp_path, monkeypatch):
    """Issue 42.4: MLFLOW_TRACKING_URI was ignored (the run wrote run_dir/mlflow.db); MLflow's own clients honour it,
    as W&B's WANDB_MODE is now. The config's tracking_uri still wins; without either, the run directory's store."""
    elsewhere = f"sqlite:///{tmp_path / 'team.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    _write_run(tmp_path / "env", "mlflow")
    ids = json.loads((tmp_path / "env" / IDS_FILE).read_text())
    assert not (tmp_path / "env" / "mlflow.db").exists()
    assert mlflow_history(elsewhere, ids["mlflow_run_id"])[2]["val/all/acc/mean_at_1"] == 0.5
    own_store = (f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}", (tmp_path / "mlflow_artifacts").resolve().as_uri())
    assert mlflow_tracking_uri("http://tracking:5000", tmp_path) == ("http://tracking:5000", own_store[1])
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # control: without the variable, the run directory's own store
    assert mlflow_tracking_uri(None, tmp_path) == own_store


@pytest.fixture
def no_wandb_account(tmp_path, monkeypatch):
    """No W&B API key anywhere this process looks (a fresh home, no WANDB_API_KEY) and no W&B mode set: an online
    start fails before it reaches the network."""
    home = tmp_path / "home"
    home.mkdir()
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_wandb_mode_from_the_environment_is_kept_when_the_config_sets_none(tmp_path, no_wandb_account):
    """Issue 33.5: the config's `mode: online` default overrode WANDB_MODE=offline, so a cluster run without an
    account (or network) failed to start. A fresh process: W&B reads its environment once per process."""
    start = textwrap.dedent(f"""
        from dapo_megatron.config import load_config
        from dapo_megatron.metrics.loggers import build_loggers
        config = load_config({str(TINY)!r}, ["trainer.loggers=[wandb]"])
        assert config.trainer.wandb.mode is None
        for logger in build_loggers(config, {str(tmp_path)!r}, resume=False):
            logger.log_scalars(1, {{"actor/entropy": 1.0}})
            logger.close()
    """)
    result = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, cwd=REPO, timeout=300,
                            env=cli_env(WANDB_MODE="offline"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((tmp_path / "wandb").glob("offline-run-*")), "W&B ran online, not as WANDB_MODE says"


def test_wandb_without_an_api_key_is_one_config_line_and_leaves_no_tensorboard_file(tmp_path, no_wandb_account):
    """Issue 33.4/33.5: W&B online without a key was a UsageError traceback, and each failed start left one more
    TensorBoard events file (TensorBoard was started first)."""
    config = load_config(TINY, [f"trainer.run_dir={tmp_path}", "trainer.loggers=[tensorboard, wandb]",
                                "trainer.wandb.mode=online"])
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"^trainer.loggers: wandb did not start: .*API key.* \(or log "
                                              r"offline: WANDB_MODE=offline, or trainer.wandb.mode=offline\)$"):
            build_loggers(config, tmp_path, resume=False)
    assert not list(tmp_path.rglob("events.out.tfevents.*"))
    offline = load_config(TINY, [f"trainer.run_dir={tmp_path}", "trainer.loggers=[tensorboard, wandb]",
                                 "trainer.wandb.mode=offline"])
    for logger in build_loggers(offline, tmp_path, resume=False):  # the control: a start that works makes one
        logger.close()
    assert len(list(tmp_path.rglob("events.out.tfevents.*"))) == 1
