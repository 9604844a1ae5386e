"""What a resumed run may change, and the record of its configs (dapo_megatron/run/config_record.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dapo_megatron.config import ConfigError, config_to_dict, load_config
from dapo_megatron.run.config_record import check_resume_config, record_start

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def _resumed(*overrides: str):
    return load_config(TINY, list(overrides))


def test_settings_that_define_the_run_are_refused_with_every_changed_key_named():
    previous = config_to_dict(_resumed())
    changed = _resumed("rollout.n_samples=16", "algorithm.eps_high=0.2", "trainer.train_batch_size=64",
                       "trainer.seed=3", "model.tiny.hidden_size=64", "trainer.total_steps=100")
    with pytest.raises(ConfigError) as refused:
        check_resume_config(previous, changed, where="the run in runs/x (checkpoint step_000020)")
    message = str(refused.value)
    assert message.startswith("--resume: the run in runs/x (checkpoint step_000020) was trained with other settings "
                              "that cannot change mid-run: ")
    for named in ("rollout.n_samples 8 -> 16", "algorithm.eps_high 0.28 -> 0.2", "trainer.train_batch_size 32 -> 64",
                  "trainer.seed 0 -> 3", "model.tiny.hidden_size 128 -> 64"):
        assert named in message
    assert "total_steps" not in message  # allowed: not among the refused


def test_settings_that_do_not_change_what_is_trained_may_change():
    previous = config_to_dict(_resumed())
    allowed = _resumed("trainer.total_steps=100", "eval.every=5", "trainer.save_every=7", "trainer.keep_checkpoints=1",
                       "trainer.run_dir=elsewhere", "rollout.sglang.request_timeout_s=60", "trainer.tensorboard=false")
    changes = check_resume_config(previous, allowed, where="x")
    assert changes == {"trainer.total_steps": (60, 100), "eval.every": (20, 5), "trainer.save_every": (20, 7),
                       "trainer.keep_checkpoints": (3, 1), "trainer.run_dir": ("runs/tiny_cpu", "elsewhere"),
                       "rollout.sglang.request_timeout_s": (600.0, 60.0), "trainer.tensorboard": (True, False)}
    assert check_resume_config(previous, _resumed(), where="x") == {}


def test_a_key_the_older_config_lacks_is_not_a_change():
    previous = config_to_dict(_resumed())
    del previous["algorithm"]["tis_cap"]  # a config written before the key existed
    assert check_resume_config(previous, _resumed("algorithm.tis_cap=3.0"), where="x") == {}


def test_every_start_is_recorded_and_config_yaml_is_the_latest(tmp_path):
    first = _resumed()
    run_id = record_start(tmp_path, first, run_id=None, step=0, resumed_from=None)
    checkpoint = tmp_path / "checkpoints" / "step_000020"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.yaml").write_text((tmp_path / "config.yaml").read_text())
    second = _resumed("trainer.total_steps=100", "eval.every=10")
    assert record_start(tmp_path, second, run_id=run_id, step=20, resumed_from=checkpoint) == run_id
    rows = [json.loads(line) for line in (tmp_path / "config_history.jsonl").read_text().splitlines()]
    assert [(r["start"], r["step"], r["run_id"]) for r in rows] == [("new", 0, run_id), ("resume", 20, run_id)]
    assert rows[0]["config"] == config_to_dict(first)
    assert rows[1]["changed"] == {"trainer.total_steps": [60, 100], "eval.every": [20, 10]}
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == config_to_dict(second)
