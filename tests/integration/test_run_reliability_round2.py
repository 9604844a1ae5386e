"""Issue 33, with real ``dapo-megatron train`` processes: a checkpoint of same-size garbage is set aside and the one
before it resumed exactly; a reward that fails on every response ends the run with a reward error (exit 8) naming
the first failure. Each case is one or two CLI runs of a small model (~15-25 s each on 2 cores)."""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path

import pytest
from cli_runs import check_run, read_run_metrics, run_cli
from test_run_reliability import _train
from test_user_errors import assert_one_line_error

from dapo_megatron.checkpoint import checkpoint_problems

pytestmark = pytest.mark.slow


def _garble_tensor_data(shard: Path) -> int:
    """Overwrite the raw bytes of every tensor in a distributed-checkpoint shard with 0xFF (a NaN in any float
    format), leaving the archives around them whole: same size, same structure, loadable. Returns the bytes hit."""
    from torch.distributed.checkpoint import FileSystemReader

    data = bytearray(shard.read_bytes())
    hit = 0
    for info in FileSystemReader(str(shard.parent)).read_metadata().storage_data.values():
        if info.relative_path != shard.name:
            continue
        item = bytes(data[info.offset:info.offset + info.length])
        if not zipfile.is_zipfile(io.BytesIO(item)):
            continue  # a pickled object, not a tensor
        with zipfile.ZipFile(io.BytesIO(item)) as archive:
            for entry in archive.infolist():
                if "/data/" not in entry.filename:
                    continue
                local = item[entry.header_offset:entry.header_offset + 30]
                start = (info.offset + entry.header_offset + 30 + int.from_bytes(local[26:28], "little")
                         + int.from_bytes(local[28:30], "little"))
                data[start:start + entry.file_size] = b"\xff" * entry.file_size
                hit += entry.file_size
    shard.write_bytes(bytes(data))
    return hit


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    check_run(*_train(run_dir, "trainer.total_steps=4", "trainer.save_every=2"))
    return run_dir


def test_a_checkpoint_of_same_size_garbage_is_set_aside_and_the_one_before_resumed_exactly(finished_run, tmp_path):
    """Issue 33.4: the newest checkpoint's weights overwritten with garbage of the same size pass every file check
    and loaded as NaN: the run went on from a NaN policy. Now: a warning, the checkpoint kept aside as damaged, the
    step-2 one resumed, and the metrics are the uninterrupted run's."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    newest = run_dir / "checkpoints" / "step_000004"
    before = {p: p.stat().st_size for p in (newest / "model").glob("*.distcp")}
    assert sum(_garble_tensor_data(shard) for shard in before) > 0
    assert {p: p.stat().st_size for p in before} == before and checkpoint_problems(newest, world_size=1) == []
    resumed = check_run(*_train(run_dir, "trainer.total_steps=4", "trainer.save_every=2"), "--resume")
    assert (f"--resume: {newest} is damaged (" in resumed.stderr
            and "weight tensors hold NaN or infinite values once loaded)" in resumed.stderr), resumed.stderr[-3000:]
    assert "resumed from " + str(run_dir / "checkpoints" / "step_000002") in resumed.stderr
    assert (run_dir / "checkpoints" / "step_000004.damaged").is_dir()
    assert read_run_metrics(run_dir) == read_run_metrics(finished_run)


def test_a_garbage_checkpoint_with_none_before_it_is_a_checkpoint_error(finished_run, tmp_path):
    """Only the optimizer's state garbled (issue 42.4: the check covered the weights alone, and the run resumed with
    NaN Adam moments, so its first update made the weights NaN)."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000002")
    newest = run_dir / "checkpoints" / "step_000004"
    assert sum(_garble_tensor_data(shard) for shard in (newest / "optimizer").glob("*.distcp")) > 0
    result = run_cli(*_train(run_dir, "trainer.total_steps=6", "trainer.save_every=2"), "--resume")
    assert_one_line_error(result, "checkpoint", f"--resume: {newest} is damaged (")
    assert "optimizer state tensors hold NaN or infinite values once loaded" in result.stderr
    assert "no complete checkpoint is left before it" in result.stderr


def test_a_reward_that_fails_on_every_response_ends_the_run_with_a_reward_error(tmp_path):
    """Issue 33.2: before, 1536 reward errors a step, nothing trained, exit 0 and a last line blaming
    rollout.max_response_length."""
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 'not a number'\n")
    result = run_cli(*_train(tmp_path / "run", "trainer.total_steps=3", f"reward.function={reward}:compute_score",
                             "reward.num_workers=1", "trainer.train_batch_size=8", "trainer.mini_batch_size=4"))
    line = assert_one_line_error(result, "reward", "the reward failed on ")
    assert "more than reward.max_error_fraction=0.5; the first failure: reward function " in line
    assert "str" in line and "max_response_length" not in result.stderr
