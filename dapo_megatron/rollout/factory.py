"""``rollout.engine`` → a rollout engine. Either way it starts without trusted weights: the trainer's first
weight handoff (version = the step it starts from) fills it, so the served weights always come from the policy."""

from __future__ import annotations

from pathlib import Path

from dapo_megatron.config import DAPOConfig
from dapo_megatron.hf_format import load_hf_config
from dapo_megatron.rollout.engine import RolloutEngine
from dapo_megatron.rollout.sglang_engine import SGLangEngine
from dapo_megatron.rollout.sglang_server import served_dtype


def build_rollout_engine(config: DAPOConfig, hf_dir: str | Path, run_dir: str | Path) -> RolloutEngine:
    r = config.rollout
    if r.engine == "embedded":
        # Import cost: the in-process engine loads transformers' model classes (0.47 s on top of torch and
        # transformers, measured with `python -X importtime`), which a run on SGLang servers never uses.
        from dapo_megatron.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine(load_hf_config(hf_dir), r.embedded)
    return SGLangEngine(r.sglang, model_path=hf_dir, run_dir=Path(run_dir) / "sglang",
                        dtype=served_dtype(config.model.precision))
