"""Where launched SGLang servers run next to the trainer on one node, and the NCCL setting a GPU weight broadcast needs.

GPUs. Trainer local rank ``r`` drives GPU ``r % visible GPUs``; the servers the engine launches on that node take the
GPUs after them by default: server ``i`` with ``tp_per_server = T`` gets ``[base + i·T, base + (i+1)·T)``, ``base``
being ``rollout.sglang.base_gpu_id`` or, when unset, the number of trainer ranks on the node. A layout that puts a
server on a trainer GPU is refused with the ``distributed`` transport: trainer rank 0 and that server would join one
NCCL communicator from the same GPU, which NCCL rejects ("Duplicate GPU detected"). With the other transports sharing
a GPU is allowed (set ``rollout.sglang.mem_fraction_static`` so both fit).

NCCL_CUMEM_ENABLE. SGLang starts its processes with NCCL's cuMem allocator off unless the variable is already set;
the trainer keeps NCCL's default (on). When NCCL carries the weights (the ``distributed`` transport on GPUs) both ends
of that communicator run with it off, as verl does for the same actor → rollout broadcast: mixed settings are a known
source of hangs there. The trainer process must have it before its first NCCL communicator exists, so the CLI sets it
before ``init_distributed``; the servers get it in their launch environment.
"""

from __future__ import annotations

from dapo_megatron.config import ConfigError, DAPOConfig, SGLangConfig

NCCL_CUMEM_OFF = {"NCCL_CUMEM_ENABLE": "0"}


def server_gpu_ranges(config: SGLangConfig, *, trainer_local_ranks: int, visible_gpus: int) -> list[range]:
    """The GPUs of each launched server (indices among this process's visible GPUs); :class:`ConfigError` naming the
    keys when the layout does not fit the node or collides with the trainer under the ``distributed`` transport."""
    tp = config.tp_per_server
    base = trainer_local_ranks if config.base_gpu_id is None else config.base_gpu_id
    ranges = [range(base + i * tp, base + (i + 1) * tp) for i in range(config.num_servers)]
    needed = ranges[-1].stop
    if needed > visible_gpus:
        where = "unset: after the trainer's ranks" if config.base_gpu_id is None else str(config.base_gpu_id)
        raise ConfigError(
            f"rollout.sglang.base_gpu_id ({where}), num_servers ({config.num_servers}) and tp_per_server ({tp}) "
            f"put the servers on GPUs {base}..{needed - 1}, but this node shows {visible_gpus} GPU(s) to the trainer "
            f"(with {trainer_local_ranks} trainer rank(s) on it)")
    if config.transport == "distributed":
        trainer_gpus = {rank % visible_gpus for rank in range(trainer_local_ranks)}
        shared = sorted(trainer_gpus.intersection(gpu for gpus in ranges for gpu in gpus))
        if shared:
            raise ConfigError(
                f"rollout.sglang.base_gpu_id ({config.base_gpu_id}) puts SGLang servers on trainer GPU(s) {shared}, "
                f"which rollout.sglang.transport=distributed cannot use: NCCL refuses a weight-update group with two "
                f"members on one GPU (\"Duplicate GPU\"). Leave base_gpu_id unset (servers after the trainer's "
                f"{trainer_local_ranks} GPU(s)) or use transport=tensor/disk to share GPUs")
    return ranges


def nccl_carries_weights(transport: str, device: str) -> bool:
    """The ``distributed`` transport broadcasts over NCCL on GPUs (gloo on CPU)."""
    return transport == "distributed" and device == "cuda"


def trainer_nccl_env(config: DAPOConfig, *, cuda_available: bool) -> dict[str, str]:
    """Variables the trainer process sets before it creates any NCCL communicator (see the module docstring)."""
    r = config.rollout
    uses_nccl = r.engine == "sglang" and nccl_carries_weights(r.sglang.transport, "cuda" if cuda_available else "cpu")
    return dict(NCCL_CUMEM_OFF) if uses_nccl else {}
