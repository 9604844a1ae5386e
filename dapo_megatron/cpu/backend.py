"""The CPU backend: megatron-core on CPU over gloo, with this folder's layers, packing, handoff gather and SGLang
stand-in (:mod:`dapo_megatron.cpu`)."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager

from dapo_megatron.backend.base import Backend
from dapo_megatron.config.model import Recompute
from dapo_megatron.cpu.attention import RotarySettings
from dapo_megatron.cpu.layers import local_layer_spec
from dapo_megatron.cpu.segment_packing import SegmentPacker
from dapo_megatron.cpu.sglang import server_pythonpath
from dapo_megatron.cpu.shm_gather import SharedMemoryGather
from dapo_megatron.overrides.megatron_core import cpu_compat
from dapo_megatron.policy.model_spec import ModelSpec


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    collective = "gloo"
    rope_in_attention = True  # the CPU attention rotates each token by its position in its own sample

    def __init__(self) -> None:
        super().__init__()
        self.packer = SegmentPacker()
        self.tp_gather = SharedMemoryGather()

    def prepare_process(self) -> None:
        super().prepare_process()
        cpu_compat.install()

    def layer_spec(self, spec: ModelSpec, num_layers: int | None):
        return local_layer_spec(RotarySettings(spec.rope_theta, spec.rope_llama3_factor), num_layers,
                                qk_norm=spec.qk_norm, num_experts=spec.moe.num_experts if spec.moe else None)

    def host_compute(self) -> AbstractContextManager:
        return cpu_compat.suspended()

    def recompute(self, requested: Recompute) -> Recompute:
        """None: memory is not what limits a CPU run (the demo), and recomputing would only cost time."""
        return "none"

    def sglang_server_environment(self, environment: dict[str, str]) -> dict[str, str]:
        """SGLang's CPU engine, and the ``sgl_kernel`` stand-in ahead of the server's own ``PYTHONPATH``."""
        path = os.pathsep.join(p for p in (server_pythonpath(), environment.get("PYTHONPATH")) if p)
        return {**environment, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": path}
