"""Bad inputs of issue 27 that end in one named line instead of a traceback or a misleading message, checked at the
function that raises (the CLI's one-line printing of a UserError is tests/integration/test_user_errors.py's subject):
empty data files, a batch the data cannot fill, impossible numbers in the config, a torn metrics.jsonl, ``plot`` of a
directory without metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.data.dapo_math import load_dapo_math, write_jsonl, write_parquet
from dapo_megatron.run.input_checks import check_data_files
from dapo_megatron.metrics.writer import MetricsWriter, read_metrics
from dapo_megatron.user_errors import DataError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny_cpu.yaml"


def _row(n: int) -> dict:
    return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {n} plus zero?"}],
            "ability": "MATH", "reward_model": {"ground_truth": str(n), "style": "rule"}, "extra_info": {"index": n}}


# ---- data files ----------------------------------------------------------------------------------------------------
def test_empty_data_files_say_they_are_empty(tmp_path):
    """Before: an empty .jsonl loaded as zero rows and surfaced as "every prompt is longer than
    max_prompt_length"; an empty parquet as "not a readable parquet file"."""
    empty_jsonl = tmp_path / "empty.jsonl"
    empty_jsonl.write_text("\n\n")
    no_rows_parquet = write_parquet([_row(1)], tmp_path / "one.parquet").with_name("none.parquet")
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(tmp_path / "one.parquet").slice(0, 0), no_rows_parquet)
    zero_bytes = tmp_path / "zero.parquet"
    zero_bytes.write_bytes(b"")
    for path in (empty_jsonl, no_rows_parquet, zero_bytes):
        with pytest.raises(DataError, match=f"^{path}: the file has no rows$"):
            load_dapo_math(path)
    assert len(load_dapo_math(tmp_path / "one.parquet")) == 1  # control: the same table with its row loads


def test_a_file_whose_every_row_is_skipped_says_so(tmp_path):
    bad = write_jsonl([{**_row(n), "data_source": ""} for n in range(3)], tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match=r"none of its 3 rows is usable \(all skipped with data.on_bad_row=skip: "
                                        r"\{'data_source': 3\}\)"):
        load_dapo_math(bad, on_bad_row="skip")


def test_a_batch_larger_than_the_data_names_the_key_the_count_and_the_deduplication(tmp_path):
    same = write_jsonl([_row(7)] * 10_000, tmp_path / "same.jsonl")
    config = load_config(TINY, ["data.source=dapo_math", "warm_start.enabled=false", f"data.train_files=[{same}]",
                                "trainer.train_batch_size=8", "trainer.mini_batch_size=8",
                                "algorithm.dynamic_sampling=false"])
    with pytest.raises(ConfigError, match=rf"^trainer.train_batch_size=8 needs 8 distinct training prompts per "
                                          rf"draw, but there is only 1 \(data.train_files: {same}: 10000 rows, "
                                          rf"deduplicated to 1 unique prompt\)$"):
        check_data_files(config)
    with pytest.raises(ConfigError, match="^algorithm.gen_batch_size=48 needs 48 distinct training prompts"):
        check_data_files(load_config(TINY, ["data.synthetic.num_train=40"]))  # dynamic sampling draws 48 a round
    enough = write_jsonl([_row(n) for n in range(8)], tmp_path / "enough.jsonl")
    check_data_files(load_config(TINY, ["data.source=dapo_math", "warm_start.enabled=false",
                                        f"data.train_files=[{enough}]",
                                        "trainer.train_batch_size=8", "trainer.mini_batch_size=8",
                                        "algorithm.dynamic_sampling=false"]))  # control: eight prompts fill it


# ---- config numbers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["optim.lr=.inf"], "optim.lr: must be a finite number, got inf"),
    (["rollout.temperature=.nan"], "rollout.temperature: must be a finite number, got nan"),
    (["rollout.n_samples=1", "algorithm.dynamic_sampling=false"], "rollout.n_samples: must be >= 2"),
    (["trainer.mini_batch_size=0"], "trainer.mini_batch_size: must be >= 1, got 0"),
    (["rollout.max_response_length=0"], "rollout.max_response_length: must be >= 1"),
    (["data.synthetic.num_train=0"], "data.synthetic.num_train: must be >= 1"),
])
def test_numbers_no_run_can_use_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=f"^{message}".replace("(", r"\(")):
        load_config(TINY, overrides)


# ---- metrics.jsonl and plot ----------------------------------------------------------------------------------------
def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, caplog):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(4):
        writer.log(step, {"critic/score/mean": step / 10})
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 4, "critic/sco')  # killed while appending step 4
    assert [row["step"] for row in read_metrics(tmp_path)] == [0, 1, 2, 3]
    assert "metrics.jsonl: skipped line 5, not a whole metrics row" in caplog.text
    writer.truncate_after(2)  # what a resume from step 2 does
    assert path.read_text() == "".join(json.dumps({"step": s, "critic/score/mean": s / 10}) + "\n" for s in range(3))


def _plot(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dapo_megatron.cli", "plot", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_plot_of_a_directory_without_metrics_is_one_line(tmp_path):
    result = _plot(tmp_path)
    assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == (f"data error: plot {tmp_path}: no metrics.jsonl in it (the run directory of a "
                                     f"`dapo-megatron train` run has one once it has logged its first step)")
    (tmp_path / "metrics.jsonl").write_text("")
    assert _plot(tmp_path).stderr.strip() == f"data error: plot {tmp_path}: {tmp_path}/metrics.jsonl has no metrics " \
                                             f"rows yet"


TORCH_LOADED = """
import sys
from dapo_megatron import cli
code = cli.main({argv!r})
print(code, "torch" in sys.modules)
"""


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_config_error_is_reported_before_torch_is_imported(command):
    """A typo in a config is answered in a fraction of a second, not after torch and megatron-core load (~8 s)."""
    argv = [command, str(TINY), "rollout.n_samples=many"] + (["--ckpt", "nowhere"] if command == "eval" else [])
    result = subprocess.run([sys.executable, "-c", TORCH_LOADED.format(argv=argv)], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert "config error: rollout.n_samples: expected an integer, got 'many'" in result.stderr
    assert result.stdout.split() == ["2", "False"], result.stdout + result.stderr[-2000:]
    # the control: the check sees torch when something imports it (the process layout of a valid config does)
    probe = "import sys, dapo_megatron.platform; print('torch' in sys.modules)"
    control = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert control.stdout.split() == ["True"], control.stderr[-2000:]
