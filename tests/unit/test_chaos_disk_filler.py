"""bench/chaos.py's disk-full fault: its filler fills the checkpoint filesystem even when a checkpoint being written
takes space between the filler's reading of the free space and its writes (a long-form run crashed on that race
with ``OSError: [Errno 28]`` before). Needs root for the tmpfs, as the fault itself does."""

from __future__ import annotations

import shutil
import subprocess

import chaos


def test_the_filler_fills_a_disk_that_a_checkpoint_write_shrank_meanwhile(tmp_path, monkeypatch):
    ballast = chaos.mount_tmpfs(tmp_path / "run", size_mb=4)
    try:
        real_usage = shutil.disk_usage

        def usage_then_a_checkpoint_write(path):
            reading = real_usage(path)
            (ballast.parent / "step_000003.tmp").write_bytes(b"\0" * 2**20)  # the writer, after the reading
            return reading

        monkeypatch.setattr(chaos.shutil, "disk_usage", usage_then_a_checkpoint_write)
        chaos.fill(ballast)
        monkeypatch.undo()
        assert shutil.disk_usage(ballast.parent).free < 2**20, "the filler left room for a checkpoint"
        assert ballast.stat().st_size > 2 * 2**20
    finally:
        subprocess.run(["umount", "-l", str(ballast.parent)], check=False)
