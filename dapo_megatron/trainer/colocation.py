"""The trainer's side of the turns it takes with SGLang servers on its own GPUs (``rollout.placement: colocated``).

Every rank calls these; the engine lives on global rank 0, whose outcome :func:`~dapo_megatron.rank_zero.run_on_rank0`
shares, so every rank also waits there until the servers have moved their memory. The turns of a step
(:mod:`dapo_megatron.rollout.placement` has the servers' side and the SGLang facts):

* :meth:`Colocation.generating`, around every generation (a step's rollouts, validation, the servers' launch): on
  entry each rank whose GPU hosts a server frees its gradient buffers, moves its optimizer state to host memory
  (``rollout.offload_optimizer``) and returns its allocator's cached blocks to the driver, then the servers take
  their KV cache back; on exit the servers release it, then the optimizer state and the gradient buffers come back;
* :meth:`Colocation.before_policy_update`: the servers release their weights;
* :meth:`Colocation.before_handoff`: each rank returns its allocator's cached blocks (the update's activations),
  so that the handoff can map the servers' weights again and fill them; :meth:`Colocation.handoff_copies` says
  whether the handoff gives each server rank the copy on its own GPU (:mod:`dapo_megatron.handoff.gpu_copies`).

Where the servers go is decided once, here, on every rank (:meth:`Colocation.locate_servers`); the engine launches
them on :attr:`Colocation.server_gpus`.

Under separate placement every turn does nothing. The optimizer state moves with megatron-core's facility for RL,
``MegatronOptimizer.offload_to_cpu`` / ``restore_from_cpu`` (0.16.1: the fp32 main parameters and Adam's moments;
megatron's own RL loop calls them around inference the same way), the gradient buffers with
``DistributedDataParallel.offload_grad_buffers`` / ``restore_grad_buffers`` (their storage freed and reallocated
zeroed: between steps they hold nothing); the bf16 weights stay. Ranks on other nodes, or on GPUs without a server,
move nothing (:func:`~dapo_megatron.rollout.placement.rank_shares_a_server_gpu`).

With LoRA the frozen base (every parameter that does not train) is on the GPU only for the policy update
(:class:`FrozenWeights`): it leaves on entry to a generation turn and before an adapter handoff (which reads the
adapters alone), and comes back once the servers released their weights for the update. It never changes, so its
host copy is made once; each return is one host-to-device copy. That is what puts a 7B policy and its server on one
24 GB GPU (examples/lora_qwen2.5_7b_24gb.yaml; the servers there restore their own base from host memory,
``--enable-weights-cpu-backup``, rollout/sglang/lora_adapters.py).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch

from dapo_megatron.config import DAPOConfig
from dapo_megatron.handoff.gpu_copies import GpuCopies
from dapo_megatron.launch_env import launch_env, local_world_size
from dapo_megatron.rank_zero import run_on_rank0
from dapo_megatron.rollout.engine import RolloutEngine
from dapo_megatron.rollout.placement import (
    colocated_gpu_ranges,
    rank_shares_a_server_gpu,
    require_one_stage_per_server,
)
from dapo_megatron.rollout.sglang.tensor_payloads import serialize_by_reference
from dapo_megatron.rollout.sglang.transports import IPC_WINDOW_BUCKETS, collect_ipc_memory

logger = logging.getLogger(__name__)


class FrozenWeights:
    """The parameters of ``model`` that never train (a LoRA policy's base), off the device between policy updates:
    :meth:`release` frees their device storage (the first time after copying them to host memory, pinned when the
    device is a GPU), :meth:`restore` copies them back. Megatron's DDP and optimizer hold no buffer for them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.parameters = [p for p in model.parameters() if not p.requires_grad]
        self._host: list[torch.Tensor] | None = None
        self.on_device = True

    def release(self) -> None:
        if not self.on_device or not self.parameters:
            return
        if self._host is None:  # one host copy per parameter, straight into pinned memory on a GPU (no staging copy)
            pinned = self.parameters[0].is_cuda
            self._host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pinned).copy_(p.detach())
                          for p in self.parameters]
        for parameter in self.parameters:
            parameter.data = parameter.data.new_empty(0)
        self.on_device = False

    @contextmanager
    def shapes_kept(self) -> Iterator[None]:
        """While released: each frozen parameter as a zero-stride view of one zero with its own shape, for code that
        reads their shapes only — megatron's sharded state dict of a checkpoint, which then keeps the adapters alone
        (:func:`dapo_megatron.checkpoint.save_load.model_sharded_state_dict`). Outside this, a released parameter has
        no elements, so a forward that should not run on it fails instead of computing with zeros."""
        if self.on_device:
            yield
            return
        for parameter, host in zip(self.parameters, self._host, strict=True):
            parameter.data = parameter.data.new_zeros(()).expand(host.shape)
        try:
            yield
        finally:
            for parameter in self.parameters:
                parameter.data = parameter.data.new_empty(0)

    def restore(self) -> None:
        if self.on_device:
            return
        device = self.parameters[0].device
        for parameter, host in zip(self.parameters, self._host, strict=True):
            parameter.data = host.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.on_device = True


def copies_on_every_gpu(config: DAPOConfig, *, on_gpu: bool, world_size: int, ranks_on_node: int) -> bool:
    """Whether the weight handoff makes the buckets on every trainer GPU and hands each colocated server rank its own
    GPU's copy by CUDA IPC handle: colocated servers this run launches on CUDA (their GPUs known), the ``tensor``
    transport, one pipeline stage (a rank holds its stage's layers only) and one node (the servers' node)."""
    r = config.rollout
    return (on_gpu and r.engine == "sglang" and r.placement == "colocated" and r.sglang.transport == "tensor"
            and not r.sglang.urls and config.parallel.pipeline == 1 and world_size == ranks_on_node)


class Colocation:
    """``engine`` gives the rollout engine when it exists (rank 0), else None; ``device_type``: the backend's;
    ``model``: the DDP-wrapped stage, whose gradient buffers wait freed while the servers generate (None: they stay).
    """

    def __init__(self, config: DAPOConfig, optimizer, engine: Callable[[], RolloutEngine | None], *,
                 device_type: str, model=None) -> None:
        r = config.rollout
        self.colocated = r.placement == "colocated"
        self.on_gpu = device_type == "cuda"
        if self.colocated and r.offload_optimizer and not self.on_gpu:
            logger.info("rollout.offload_optimizer: the optimizer state is in host memory already (no GPU)")
        self.optimizer = optimizer
        self.model = model
        self.engine = engine
        self.config = config
        self.shares_a_server_gpu = True  # until locate_servers() knows this rank's GPU
        self.frozen = FrozenWeights(model) if model is not None and config.model.lora.enabled else None
        self.server_gpus: list[range] | None = None  # each launched server's GPUs, once located (CUDA, colocated)

    @property
    def offload_optimizer(self) -> bool:
        return self.colocated and self.on_gpu and self.shares_a_server_gpu and self.config.rollout.offload_optimizer

    @property
    def offload_gradients(self) -> bool:
        """The gradient buffers hold nothing between steps (the next update zeroes them first): while the servers
        generate they are freed (megatron-core's ``offload_grad_buffers``), leaving the KV cache that much more."""
        return self.colocated and self.on_gpu and self.shares_a_server_gpu and self.model is not None

    @property
    def offload_frozen_weights(self) -> bool:
        """A LoRA policy's frozen base leaves the GPU outside the update (see the module docstring)."""
        return self.colocated and self.on_gpu and self.shares_a_server_gpu and self.frozen is not None

    def locate_servers(self) -> None:
        """Before the servers launch (on GPUs; every rank, so every rank stops with the same error): each colocated
        server's GPUs lie in one pipeline stage, and a rank whose GPU hosts no server moves nothing in the turns."""
        if not (self.colocated and self.on_gpu):
            return
        r, pipeline = self.config.rollout, self.config.parallel.pipeline
        visible_gpus = torch.cuda.device_count()
        ranges = colocated_gpu_ranges(r.sglang, trainer_local_ranks=local_world_size(), visible_gpus=visible_gpus)
        ranks_per_stage = torch.distributed.get_world_size() // pipeline
        require_one_stage_per_server(r.sglang, ranges, ranks_per_stage=ranks_per_stage, pipeline=pipeline)
        here = launch_env()
        self.shares_a_server_gpu = rank_shares_a_server_gpu(ranges, global_rank=here.rank, local_rank=here.local_rank,
                                                            visible_gpus=visible_gpus)
        self.server_gpus = ranges

    def handoff_copies(self) -> GpuCopies | None:
        """This rank's part in a handoff that gives each colocated server rank the copy on its own GPU, or None
        where that route does not apply (:func:`copies_on_every_gpu`)."""
        here = launch_env()
        if not copies_on_every_gpu(self.config, on_gpu=self.on_gpu, world_size=here.world_size,
                                   ranks_on_node=local_world_size()):
            return None
        serializes = self.shares_a_server_gpu and here.rank != 0  # rank 0's transport serializes its own copy
        return GpuCopies(serialize=serialize_by_reference if serializes else None, window=IPC_WINDOW_BUCKETS,
                         collect=collect_ipc_memory)

    @contextmanager
    def generating(self) -> Iterator[None]:
        """The servers' turn (see the module docstring). An exception inside leaves the turn as it is: the run is
        ending, and no rank may start a collective that another rank, failing elsewhere, would never join."""
        if not self.colocated:
            yield
            return
        if self.offload_gradients:
            self.model.offload_grad_buffers()
        if self.offload_optimizer:
            self.optimizer.offload_to_cpu()
        if self.offload_frozen_weights:
            self.frozen.release()  # back in before_policy_update, once the servers released their weights
        self._return_cached_blocks()
        self._engine_turn("before_generation", "colocated servers taking their KV cache back")
        yield
        self._engine_turn("after_generation", "colocated servers releasing their KV cache")
        if self.offload_optimizer:
            self.optimizer.restore_from_cpu()
        if self.offload_gradients:
            self.model.restore_grad_buffers()

    def before_policy_update(self) -> None:
        if self.colocated:
            self._engine_turn("before_policy_update", "colocated servers releasing their weights")
        if self.offload_frozen_weights:
            self.frozen.restore()

    def checkpoint_access(self):
        """Around saving or loading a checkpoint: the model as the checkpoint code reads it, whichever turn this is
        (a LoRA policy's released base keeps its shapes: :meth:`FrozenWeights.shapes_kept`)."""
        return self.frozen.shapes_kept() if self.frozen is not None else nullcontext()

    def before_handoff(self, *, base_served: bool) -> None:
        """``base_served``: the servers hold the frozen base already, so the handoff reads the adapters alone (a
        first handoff to servers attached by URL sends the base too, from the GPU)."""
        if self.offload_frozen_weights and self.config.model.lora.handoff == "adapter" and base_served:
            self.frozen.release()  # the servers take their base back from host memory: one copy on the GPU
        if self.colocated:
            self._return_cached_blocks()

    def _engine_turn(self, turn: str, what: str) -> None:
        def on_rank0() -> None:
            engine = self.engine()
            if engine is not None:  # not yet, on entry to the turn that launches the servers
                getattr(engine, turn)()

        run_on_rank0(on_rank0, what=what, broadcast_result=False)

    def _return_cached_blocks(self) -> None:
        """Blocks PyTorch's caching allocator keeps for reuse count as used for the server sharing the GPU."""
        if self.on_gpu:
            torch.cuda.empty_cache()
