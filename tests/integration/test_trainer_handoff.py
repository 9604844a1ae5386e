"""The trainer's weight handoff when the engine on rank 0 fails part-way through the stream, at PP=2 and at TP=2:
every rank raises the same error well within the collective timeout (the other ranks' sends and gathers are
matched, not abandoned), and afterwards a handoff to a working engine succeeds, which needs every rank to be at the
same point of the stream again (the embedded engine rejects a set with any tensor missing, unexpected or misshapen)."""

from __future__ import annotations

import time

import pytest

from trainer_harness import build_trainer

pytestmark = pytest.mark.slow

COLLECTIVE_TIMEOUT_S = 60
BREAKS_AFTER = 2  # buckets: inside pipeline stage 0, while rank 1 waits to send stage 1 (PP) or to gather (TP)
OVERRIDES = ["warm_start.enabled=false", "data.synthetic.num_train=200", "data.synthetic.num_heldout=8",
             "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
             "rollout.handoff_bucket_mb=0.01",  # several buckets per stage, so the break is mid-stream
             f"parallel.collective_timeout_s={COLLECTIVE_TIMEOUT_S}"]


def _stream_breaking_engine(hf_config):
    from dapo_megatron.rollout.embedded.engine import EmbeddedEngine

    class StreamBreakingEngine(EmbeddedEngine):
        """The embedded engine, whose incoming weights stop after a few tensors, as when a server connection drops."""

        def update_weights(self, buckets, version):
            def breaking():
                for i, bucket in enumerate(buckets):
                    if i == BREAKS_AFTER:
                        raise ConnectionError("the inference server went away mid-update")
                    yield bucket

            super().update_weights(breaking(), version)

    return StreamBreakingEngine(hf_config)


def _handoffs(overrides: list[str]) -> dict:
    from transformers import AutoConfig

    from dapo_megatron.rank_zero import Rank0Error

    trainer = build_trainer(overrides)
    try:
        trainer.hand_off_weights(version=1)  # control: a working engine
        working_engine = trainer.engine
        if trainer.rank == 0:
            trainer.engine = _stream_breaking_engine(AutoConfig.from_pretrained(trainer.model_dir))
        start = time.monotonic()
        try:
            trainer.hand_off_weights(version=2)
            error = None
        except Rank0Error as exc:
            error = str(exc)
        seconds = time.monotonic() - start
        trainer.engine = working_engine
        trainer.hand_off_weights(version=3)
        return {"error": error, "seconds": seconds,
                "version": trainer.engine.weight_version if trainer.engine is not None else None}
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("layout", ["parallel.pipeline=2", "parallel.tensor=2"])
def test_engine_failure_mid_stream_reaches_every_rank(tmp_path, layout):
    from spawn_ranks import run_distributed

    rank0, rank1 = run_distributed(_handoffs, 2, [*OVERRIDES, f"trainer.run_dir={tmp_path}", layout],
                                   timeout_s=600)
    expected = ("weight handoff (version 2) failed on rank 0: "
                "ConnectionError: the inference server went away mid-update")
    assert rank0["error"] == rank1["error"] == expected
    assert rank0["seconds"] < COLLECTIVE_TIMEOUT_S / 2 and rank1["seconds"] < COLLECTIVE_TIMEOUT_S / 2
    assert rank0["version"] == 3  # the next handoff delivered a complete, matching set
