"""Run a whole DAPOTrainer inside a spawned rank (the CPU layer is process-wide) and report what changed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def build_trainer(overrides: list[str], config_path: str | Path = REPO / "examples" / "tiny_cpu.yaml"):
    """What ``dapo-megatron train`` does before ``run()``: distributed init, the initial model, the trainer."""
    from dapo_megatron.config import load_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.trainer.loop import DAPOTrainer
    from dapo_megatron.run.model_source import prepare_initial_model

    config = load_config(config_path, overrides)
    p = config.parallel
    backend = init_distributed(p.tensor, p.pipeline, p.data, timeout_s=p.collective_timeout_s).backend
    return DAPOTrainer(config, prepare_initial_model(config), backend)


def run_trainer(overrides: list[str], config_path: str | Path = REPO / "examples" / "tiny_cpu.yaml") -> dict:
    """Build the trainer from ``config_path`` + ``overrides``, run it, and return on every rank how many of its
    parameters moved (vocabulary-padding shards excluded: they hold zeros that never get a gradient, and must stay
    so), the engine's weight version (rank 0) and the logged metrics (rank 0)."""
    import torch
    from megatron.core import parallel_state

    from dapo_megatron.metrics.writer import read_metrics

    trainer = build_trainer(overrides, config_path)
    before = {n: p.detach().clone() for n, p in trainer.actor.model.named_parameters()}
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    padding_only = {n for n, t in before.items() if n.endswith(("word_embeddings.weight", "output_layer.weight"))
                    and tp_rank * t.shape[0] >= trainer.spec.vocab_size}
    real = set(before) - padding_only
    try:
        trainer.run()
        params = dict(trainer.actor.model.named_parameters())
        changed = sum(int(not torch.equal(before[n], params[n].detach())) for n in real)
        padding_moved = any(params[n].detach().any() for n in padding_only)
        version = trainer.engine.weight_version if trainer.engine is not None else None
    finally:
        trainer.shutdown()
    return {"changed": changed, "num_params": len(real), "padding_moved": padding_moved, "version": version,
            "metrics": read_metrics(trainer.run_dir) if trainer.rank == 0 else None}


def sglang_python() -> str:
    """The server python: DAPO_SGLANG_PYTHON, default this one; the test skips when it has no SGLang."""
    from dapo_megatron.rollout.engine import RolloutError
    from dapo_megatron.rollout.sglang.server import require_sglang

    python = os.environ.get("DAPO_SGLANG_PYTHON", sys.executable)
    try:
        require_sglang(python)
    except RolloutError as error:
        pytest.skip(f"SGLang is not importable by {python}: {error}")
    return python


def small_sglang_run(run_dir: str | Path) -> list[str]:
    """Overrides of examples/tiny_cpu_sglang.yaml for two quick DAPO steps at TP=2 on a real SGLang server
    (:func:`sglang_python`)."""
    python = sglang_python()
    return [f"trainer.run_dir={run_dir}", f"rollout.sglang.python={python}", "warm_start.enabled=false",
            "trainer.total_steps=2", "trainer.train_batch_size=4", "trainer.mini_batch_size=2",
            "rollout.n_samples=4", "data.synthetic.num_train=200", "data.synthetic.num_heldout=8",
            "eval.every=0", "trainer.save_every=2", "rollout.max_response_length=24",
            "algorithm.overlong_buffer_len=4", "algorithm.dynamic_sampling=false",
            "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
            "parallel.tensor=2"]
