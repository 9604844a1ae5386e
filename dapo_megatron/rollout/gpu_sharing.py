"""GPU memory of a trainer GPU that an SGLang server shares (``rollout.placement: colocated``), for ``dapo-megatron
plan``: :func:`sharing_report`, printed after :mod:`dapo_megatron.policy.memory.gpu`'s table of the trainer alone.

Colocated, every trainer GPU also holds one TP rank of a server, and the two take turns
(:mod:`dapo_megatron.rollout.placement`, :mod:`dapo_megatron.trainer.colocation`). A GPU of ``G`` bytes, on each
pipeline stage (their trainer footprints differ), must hold in every turn:

* generation: the trainer's weights and fixed margin (its gradient buffers are freed, and its optimizer state moved to
  host memory with ``rollout.offload_optimizer``); the server's context ``C``, its static memory ``S``
  (weights + KV cache) and the runtime memory ``R`` SGLang keeps for its activations and CUDA graphs;
* training: the trainer's peak (:func:`dapo_megatron.policy.memory.gpu.estimate_memory`) and ``C`` (the server released
  everything else, its CUDA graphs too: the server is launched with ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1`` unless the
  user set it);
* weight handoff: the trainer without activations plus the handoff buckets it holds at once
  (:func:`handoff_buckets_on_gpu`); ``C`` and the server's weights.

``S`` is fixed when the server starts. SGLang 0.5.23 (``mem_cache/kv_cache_configurator.py``,
``_profile_available_bytes``) gives the KV cache the memory free once its weights are loaded minus ``(1 − f)·B``, ``B``
being the memory free before they were and ``f`` = ``rollout.sglang.mem_fraction_static``: so ``S = f·B``. The trainer
launches the servers inside a generation turn, so ``B = G − C − the trainer's generation footprint`` at that moment.
Without offloading, Adam's moments do not exist yet then (the first update creates them): they come out of the
``(1 − f)·B`` that is left, on top of ``R``.

``R`` is SGLang's own estimate, the one it picks its default ``mem_fraction_static`` with (0.5.23
``arg_groups/memory_hook.py``): 512 MiB + 1.5 MiB per token of the chunked-prefill size + TP/8 GiB + 2 MiB per
decode CUDA-graph batch slot, with the prefill size and graph batch SGLang picks for the GPU's memory
(:func:`sglang_runtime_reserve_bytes`; its floor of 10 GiB above 60 GiB never binds at those defaults, and its prefill
CUDA graphs, a few tens of MiB, are left out). Prefill sizes set in ``extra_server_args`` are not read.

``C``, a server's CUDA context plus what it allocates outside the memory saver's regions, is an assumption:
:data:`SERVER_CONTEXT_BYTES`, not measured (nothing of this project has run on a GPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dapo_megatron.config import DAPOConfig
from dapo_megatron.policy.lora.sizes import adapter_sizes, linear_shapes, model_parameter_count
from dapo_megatron.rollout.sglang.lora_adapters import LORA_SLOTS
from dapo_megatron.policy.memory.gpu import FIXED_MARGIN_BYTES, GB, StageMemory
from dapo_megatron.policy.model_spec import ModelSpec
from dapo_megatron.rollout.sglang.server import MEMORY_SAVER_CUDA_GRAPH_ENV, cuda_graphs_released
from dapo_megatron.rollout.sglang.transports import IPC_WINDOW_BUCKETS

MIB = 2**20
GIB = 2**30
SERVER_CONTEXT_BYTES = 2 * GB

# SGLang 0.5.23's defaults by GPU memory (GiB): (below, chunked-prefill tokens, decode graph batch at TP < 4 and >= 4).
_SGLANG_GPU_DEFAULTS = ((20, 2048, 8, 8), (35, 4096, 48, 160), (60, 4096, 32, 160), (90, 8192, 256, 512),
                        (160, 8192, 256, 512), (float("inf"), 16384, 512, 512))


def _sglang_defaults(gpu_bytes: int, tp: int) -> tuple[int, int]:
    """SGLang 0.5.23's chunked-prefill size and decode CUDA-graph batch for a GPU of ``gpu_bytes`` at TP ``tp``."""
    _, prefill, small_tp_graph, large_tp_graph = next(row for row in _SGLANG_GPU_DEFAULTS if gpu_bytes / GIB < row[0])
    return prefill, small_tp_graph if tp < 4 else large_tp_graph


def sglang_cuda_graph_bytes(gpu_bytes: int, tp: int) -> int:
    """The decode CUDA graphs' share of :func:`sglang_runtime_reserve_bytes`: 2 MiB per graph batch slot."""
    return 2 * _sglang_defaults(gpu_bytes, tp)[1] * MIB


def sglang_runtime_reserve_bytes(gpu_bytes: int, tp: int) -> int:
    """The memory SGLang 0.5.23 keeps for activations and CUDA graphs on a GPU of ``gpu_bytes`` at TP ``tp``."""
    prefill, _ = _sglang_defaults(gpu_bytes, tp)
    return int((512 + 1.5 * max(prefill, 2048) + tp / 8 * 1024) * MIB) + sglang_cuda_graph_bytes(gpu_bytes, tp)


def model_parameters(spec: ModelSpec) -> int:
    """Parameters of the whole model as SGLang serves it (the unpadded vocabulary; a MoE model's experts too)."""
    return model_parameter_count(spec)


FP8_FLAG = ("--quantization", "fp8")


def served_weight_bytes(spec: ModelSpec, dtype_bytes: int, server_args: list[str]) -> int:
    """The weights of a server: every parameter at ``dtype_bytes``, or with ``--quantization fp8`` among its
    arguments the linear layers' at 1 byte (SGLang quantizes them on load; embeddings, norms and the output layer
    stay)."""
    total = model_parameters(spec) * dtype_bytes
    quantized = any(server_args[i:i + 2] == list(FP8_FLAG) for i in range(len(server_args) - 1)) \
        or f"{FP8_FLAG[0]}={FP8_FLAG[1]}" in server_args
    if not quantized:
        return total
    linears = sum(n_in * n_out * copies for n_in, n_out, copies in linear_shapes(spec).values()) * spec.num_layers
    return total - linears * (dtype_bytes - 1)


def handoff_buckets_on_gpu(transport: str) -> int:
    """Buckets of the weight handoff on a trainer GPU at once. ``tensor`` sends GPU buckets as CUDA IPC handles and
    keeps the last :data:`~dapo_megatron.rollout.sglang.transports.IPC_WINDOW_BUCKETS` referenced after the servers
    answered, besides the one being sent and the next one the exporter gathers; the other transports hold the bucket
    being sent and the next."""
    return IPC_WINDOW_BUCKETS + 2 if transport == "tensor" else 2


def kv_bytes_per_token(spec: ModelSpec, tp: int, dtype_bytes: int) -> int:
    """KV-cache bytes of one token on one GPU of a TP-``tp`` server (KV heads split over TP, at least one each)."""
    return 2 * spec.num_layers * max(spec.num_kv_heads // tp, 1) * spec.head_dim * dtype_bytes


@dataclass(frozen=True)
class SharedGpu:
    """One GPU of pipeline stage ``stage``: (trainer, server) bytes in each turn, and the server's KV cache."""

    stage: int
    generation: tuple[int, int]
    training: tuple[int, int]
    handoff: tuple[int, int]
    kv_cache_bytes: int
    kv_cache_tokens: int

    def fits(self, gpu_bytes: float) -> bool:
        return self.kv_cache_bytes > 0 and all(sum(turn) <= gpu_bytes
                                               for turn in (self.generation, self.training, self.handoff))


def shared_gpus(config: DAPOConfig, spec: ModelSpec, stages: list[StageMemory], *, data_parallel: int,
                gpu_memory_gb: float, cuda_graphs_released: bool = True) -> list[SharedGpu]:
    """Each stage's GPU under colocated placement (see the module docstring for the model).

    ``cuda_graphs_released``: the servers' CUDA graphs live in a memory-saver region, so the training turn leaves the
    server only ``C`` (the launch environment decides:
    :func:`dapo_megatron.rollout.sglang.server.cuda_graphs_released`); otherwise the graph pools stay resident through
    the training and handoff turns."""
    r, s = config.rollout, config.rollout.sglang
    gpu = int(gpu_memory_gb * GB)
    tp, fraction = s.tp_per_server, s.mem_fraction_static
    dtype_bytes = 4 if config.model.precision == "fp32" else 2
    lora = config.model.lora
    adapters_served = lora.enabled and lora.handoff == "adapter"
    server_weights = served_weight_bytes(spec, dtype_bytes, s.extra_server_args) // tp
    if adapters_served:  # SGLang's LoRA pool: --max-loras-per-batch adapters at the rank, in the weights' dtype
        server_weights += LORA_SLOTS * adapter_sizes(spec, rank=lora.rank, target_modules=lora.target_modules
                                                     ).handoff * dtype_bytes // tp
    bucket = max(int(r.handoff_bucket_mb * MIB), spec.vocab_size * spec.hidden_size * dtype_bytes)
    handoff_buckets = handoff_buckets_on_gpu(s.transport) * bucket
    runtime = sglang_runtime_reserve_bytes(gpu, tp)
    per_token = kv_bytes_per_token(spec, tp, dtype_bytes)
    distributed = config.parallel.use_distributed_optimizer
    moments_share = 8 / (data_parallel if distributed else 1)
    # experts' optimizer state is sharded over their own data-parallel group: DP / EP ranks
    expert_moments_share = 8 / (data_parallel // config.parallel.expert if distributed else 1)
    resident_graphs = 0 if cuda_graphs_released else sglang_cuda_graph_bytes(gpu, tp)
    result = []
    for stage in stages:
        trained = stage.parameters - stage.frozen_parameters
        moments = int((trained - stage.expert_parameters) * moments_share
                      + stage.expert_parameters * expert_moments_share)
        main_params = stage.optimizer_bytes - moments
        resident = stage.params_bytes + stage.grads_bytes + FIXED_MARGIN_BYTES
        # a LoRA run's frozen base waits in host memory outside the training turn (trainer/colocation.py)
        frozen = stage.frozen_parameters * dtype_bytes
        # while the servers generate the gradient buffers are freed (dapo_megatron/trainer/colocation.py)
        at_launch = resident - stage.grads_bytes - frozen + (0 if r.offload_optimizer else main_params)
        generating = resident - stage.grads_bytes - frozen + (0 if r.offload_optimizer else stage.optimizer_bytes)
        # handing off an adapter needs no base on the trainer's side; full (or merged) weights are read from it
        handing_off = resident + stage.optimizer_bytes - (frozen if adapters_served else 0) \
            + (0 if adapters_served else handoff_buckets)
        free_at_launch = gpu - SERVER_CONTEXT_BYTES - at_launch
        static = int(fraction * free_at_launch)
        kv_cache = static - server_weights
        result.append(SharedGpu(
            stage=stage.stage,
            generation=(generating, SERVER_CONTEXT_BYTES + static + runtime),
            training=(stage.total_bytes, SERVER_CONTEXT_BYTES + resident_graphs),
            handoff=(handing_off, SERVER_CONTEXT_BYTES + server_weights + resident_graphs),
            kv_cache_bytes=kv_cache, kv_cache_tokens=max(kv_cache, 0) // per_token,
        ))
    return result


def optimizer_offloading_ranks(config: DAPOConfig, *, ranks_on_node: int, on_gpu: bool = True) -> int:
    """Trainer ranks of rank 0's node that move their optimizer state to host memory while colocated servers
    generate (``rollout.offload_optimizer``): those whose GPU a server's TP rank shares."""
    r = config.rollout
    if not (on_gpu and r.engine == "sglang" and r.placement == "colocated" and r.offload_optimizer):
        return 0
    return min(r.sglang.num_servers * r.sglang.tp_per_server, ranks_on_node)


def sharing_report(config: DAPOConfig, spec: ModelSpec, stages: list[StageMemory], *, data_parallel: int,
                   gpu_memory_gb: float) -> tuple[list[str], bool]:
    """``dapo-megatron plan``'s lines on what shares the trainer's GPUs, and whether each turn fits."""
    r = config.rollout
    if r.engine != "sglang":
        return [], True
    if r.placement == "separate":
        return ["SGLang servers: on GPUs of their own (rollout.placement: separate); the trainer has its GPUs to "
                "itself"], True
    s = r.sglang
    graphs_released = cuda_graphs_released(os.environ)  # what the launched servers will get (their environment)
    gpus = shared_gpus(config, spec, stages, data_parallel=data_parallel, gpu_memory_gb=gpu_memory_gb,
                       cuda_graphs_released=graphs_released)
    header = f"{'stage':>5} {'turn':<11} {'trainer':>9} {'server':>9} {'total':>9}  fits"
    lines = [f"SGLang servers on the trainer's GPUs (rollout.placement: colocated): TP {s.tp_per_server}, "
             f"mem_fraction_static {s.mem_fraction_static:g}, optimizer state "
             f"{'in host memory' if r.offload_optimizer else 'on the GPU'} while they generate; server context "
             f"{SERVER_CONTEXT_BYTES / GB:g} GB (assumed), SGLang's runtime reserve "
             f"{sglang_runtime_reserve_bytes(int(gpu_memory_gb * GB), s.tp_per_server) / GB:.1f} GB; CUDA graphs "
             + ("released with the rest" if graphs_released else
                f"resident in every turn ({MEMORY_SAVER_CUDA_GRAPH_ENV}=0)"),
             header, "-" * len(header)]
    for shared in gpus:
        for turn, (trainer, server) in (("generation", shared.generation), ("training", shared.training),
                                        ("handoff", shared.handoff)):
            fits = trainer + server <= gpu_memory_gb * GB and (turn != "generation" or shared.kv_cache_bytes > 0)
            line = (f"{shared.stage:>5} {turn:<11} {trainer / GB:>7.1f}GB {server / GB:>7.1f}GB "
                    f"{(trainer + server) / GB:>7.1f}GB  {'yes' if fits else 'NO'}")
            if turn == "generation":
                line += (f"  KV cache {shared.kv_cache_bytes / GB:.1f} GB, {shared.kv_cache_tokens / 1e6:.2f}M tokens "
                         f"per server" if shared.kv_cache_bytes > 0 else
                         "  no KV cache: SGLang refuses to start (raise mem_fraction_static)")
            lines.append(line)
    return lines, all(shared.fits(gpu_memory_gb * GB) for shared in gpus)
