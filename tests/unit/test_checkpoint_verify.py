"""Damaged checkpoints are found from file names and sizes (dapo_megatron/checkpoint/verify.py), resume falls back
past them, and retention deletes only the writing run's own checkpoints (dapo_megatron/checkpoint/save_load.py).
The distributed checkpoints here are real torch.distributed.checkpoint folders, written without megatron."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from dapo_megatron.checkpoint import (
    CheckpointError,
    checkpoint_problems,
    checkpoint_to_resume,
    list_checkpoints,
    newest_sound_checkpoint,
    step_dir,
)
from dapo_megatron.checkpoint.save_load import _remove_old_checkpoints


def _distributed_checkpoint(folder: Path, values: torch.Tensor) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "no process group": this test has none, on purpose
        warnings.simplefilter("ignore")
        dcp.save({"weight": values}, checkpoint_id=str(folder), no_dist=True)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    torch.save({}, folder / "common.pt")


def _trainer_checkpoint(root: Path, step: int, *, run_id: str | None = None) -> Path:
    path = step_dir(root, step)
    _distributed_checkpoint(path / "model", torch.arange(4096.0))
    _distributed_checkpoint(path / "optimizer", torch.ones(2048))
    (path / "rng").mkdir()
    torch.save({"python": None}, path / "rng" / "rank_0.pt")
    torch.save({"step": step}, path / "trainer_state.pt")
    if run_id is not None:
        (path / "run_id").write_text(f"{run_id}\n")
    (path / "COMPLETE").write_text(f"{step}\n")
    return path


def test_a_sound_checkpoint_has_no_problems_and_each_kind_of_damage_is_named(tmp_path):
    path = _trainer_checkpoint(tmp_path, 10)
    assert checkpoint_problems(path, world_size=1) == []
    (shard,) = (path / "model").glob("*.distcp")
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])  # a copy cut short
    assert checkpoint_problems(path, 1) == [f"model/{shard.name} is truncated ({size // 2} bytes; .metadata records "
                                            f"{size})"]
    shard.unlink()
    assert checkpoint_problems(path, 1) == [f"lacks model/{shard.name}"]
    (path / "optimizer" / ".metadata").unlink()
    assert checkpoint_problems(path, 1)[1] == "lacks optimizer/.metadata"
    (path / "trainer_state.pt").write_bytes(b"PK\x03\x04 torn")
    assert "trainer_state.pt is unreadable" in checkpoint_problems(path, 1)[-1]
    assert "rng/rank_1.pt" in checkpoint_problems(_trainer_checkpoint(tmp_path, 11), world_size=2)[0]


def test_resume_falls_back_past_damaged_checkpoints_and_keeps_them_aside(tmp_path, caplog):
    for step in (10, 20, 30):
        _trainer_checkpoint(tmp_path, step)
    (step_dir(tmp_path, 30) / "model" / ".metadata").unlink()
    (shard,) = (step_dir(tmp_path, 20) / "optimizer").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    assert newest_sound_checkpoint(tmp_path, 1)[0] == step_dir(tmp_path, 10)
    assert checkpoint_to_resume(tmp_path, world_size=1) == step_dir(tmp_path, 10)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000010"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010", "step_000020.damaged", "step_000030.damaged"]
    assert f"{step_dir(tmp_path, 30)} is damaged (lacks model/.metadata): resuming from {step_dir(tmp_path, 10)}" \
           in caplog.text
    assert checkpoint_to_resume(tmp_path, world_size=1) == step_dir(tmp_path, 10)  # and quietly next time


def test_no_sound_checkpoint_is_a_checkpoint_error(tmp_path):
    (_trainer_checkpoint(tmp_path, 5) / "model" / "common.pt").unlink()
    with pytest.raises(CheckpointError, match=rf"--resume: {step_dir(tmp_path, 5)} is marked complete but lacks "
                                              rf"model/common.pt, so there is no checkpoint to resume from"):
        checkpoint_to_resume(tmp_path, world_size=1)
    assert checkpoint_to_resume(tmp_path / "nothing_here", world_size=1) is None


def test_retention_never_deletes_the_runs_checkpoints_for_another_runs(tmp_path):
    """The issue's case: a finished run's steps 20/25/30 in the folder, a new run saving steps 2 and 4 with
    keep_checkpoints=3. Control: the old rule (the newest three of every checkpoint) would delete 2 and 4."""
    for step in (20, 25, 30):
        _trainer_checkpoint(tmp_path, step, run_id="old")
    for step in (2, 4):
        _trainer_checkpoint(tmp_path, step, run_id="new")
        _remove_old_checkpoints(tmp_path, keep=3, run_id="new", newest=step)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_000002", "step_000004", "step_000020", "step_000025", "step_000030"]
    assert names[-3:] == ["step_000020", "step_000025", "step_000030"]  # what the old rule would have kept
    for step in (6, 8):
        _trainer_checkpoint(tmp_path, step, run_id="new")
        _remove_old_checkpoints(tmp_path, keep=3, run_id="new", newest=step)
    assert [p.name for p in list_checkpoints(tmp_path)][:3] == ["step_000004", "step_000006", "step_000008"]
