"""``rollout.engine`` → a rollout engine. Either way it starts without trusted weights: the trainer's first
weight handoff (version = the step it starts from) fills it, so the served weights always come from the policy."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dapo_megatron.backend.base import Backend
from dapo_megatron.config import DAPOConfig
from dapo_megatron.hf_format import load_hf_config
from dapo_megatron.rollout.engine import RolloutEngine
from dapo_megatron.rollout.sglang.engine import SGLangEngine
from dapo_megatron.rollout.sglang.lora_adapters import lora_server_arguments
from dapo_megatron.rollout.sglang.server import served_dtype


def build_rollout_engine(config: DAPOConfig, hf_dir: str | Path, run_dir: str | Path, backend: Backend, *,
                         server_gpus: list[range] | None = None) -> RolloutEngine:
    """``backend``: the platform's (:mod:`dapo_megatron.backend`), for the host-side work of the embedded engine and
    the environment of SGLang servers; ``server_gpus``: where the trainer placed colocated servers
    (:class:`dapo_megatron.trainer.colocation.Colocation`)."""
    r = config.rollout
    # Each branch loads only its engine: an SGLang run never imports the in-process engine, nor an embedded run
    # SGLang's HTTP stack.
    if r.engine == "embedded":
        # Import cost: the in-process engine loads transformers' model classes (0.47 s on top of torch and
        # transformers, measured with `python -X importtime`), which a run on SGLang servers never uses.
        from dapo_megatron.rollout.embedded.engine import EmbeddedEngine

        return EmbeddedEngine(load_hf_config(hf_dir), r.embedded, host_compute=backend.host_compute)
    sglang, lora = r.sglang, config.model.lora
    if lora.enabled and lora.handoff == "adapter":  # servers that take the trainer's adapters (lora_adapters.py)
        sglang = replace(sglang, extra_server_args=[*sglang.extra_server_args,
                                                    *lora_server_arguments(lora, backend.device_type,
                                                                           colocated=r.placement == "colocated")])
    return SGLangEngine.launch(sglang, model_path=hf_dir, run_dir=Path(run_dir) / "sglang",
                               dtype=served_dtype(config.model.precision), backend=backend, placement=r.placement,
                               server_gpus=server_gpus)
