"""What every backend supplies (:mod:`dapo_megatron.backend` says which backend runs where). The bottom of the seam: it
imports nothing of the layers that use it (``layer_spec`` takes the policy's
:class:`~dapo_megatron.policy.model_spec.ModelSpec`, typed here as ``Any``); the packer and the TP gather are the
interfaces of :mod:`dapo_megatron.backend.interfaces`, which each concrete backend fills with its platform's
implementation (:mod:`dapo_megatron.cuda.backend`, :mod:`dapo_megatron.cpu.backend`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

from dapo_megatron.config.model import Recompute
from dapo_megatron.overrides.megatron_core.process import apply_megatron_core_overrides

if TYPE_CHECKING:
    from dapo_megatron.backend.interfaces import RowPacker, TensorParallelGather


class Backend:
    """The choices of one platform; the defaults are CUDA's. A concrete backend sets ``packer`` (how the actor lays
    samples out in rows) and ``tp_gather`` (how the weight handoff gathers TP shards) when it is made."""

    name: str = ""
    device_type: Literal["cuda", "cpu"] = "cuda"
    collective: Literal["nccl", "gloo"] = "nccl"
    uses_transformer_engine: bool = False
    rope_in_attention: bool = False  # True: the core attention rotates q/k itself (no megatron RoPE embedding)

    packer: RowPacker
    tp_gather: TensorParallelGather

    def prepare_process(self) -> None:
        """Run once per process before megatron-core does anything (on CUDA: only the megatron-core fixes every
        backend needs, :mod:`dapo_megatron.overrides.megatron_core.process`)."""
        apply_megatron_core_overrides()

    def layer_spec(self, spec: Any, num_layers: int | None):
        """megatron's layer spec for ``spec``; with ``num_layers`` (this pipeline stage's) it may be a block spec."""
        raise NotImplementedError

    def host_compute(self) -> AbstractContextManager:
        """A context for host-side tensor work that never names CUDA."""
        return nullcontext()

    def recompute(self, requested: Recompute) -> Recompute:
        """The activation recomputation a training run uses."""
        return requested

    def sglang_server_environment(self, environment: dict[str, str]) -> dict[str, str]:
        """The environment of an SGLang server launched by this process, from the one it would otherwise get."""
        return environment

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"
