"""This process on the backend's platform: its device, the process group, the seeds (the launch variables:
:mod:`dapo_megatron.launch_env`, read without torch).

What the platform calls for is decided by the backend (:mod:`dapo_megatron.backend`: the device type, the collective,
what a process needs before megatron runs); this module applies that choice to the process, the one place that
binds a device or forms a process group:

* :func:`prepare_device` — this process's device and collective backend, as the backend says: on CUDA, NCCL and GPU
  ``local_rank % visible GPUs`` (:func:`cuda_device_index`: a cluster that binds one GPU per task shows each process a
  single device 0); without CUDA, gloo, after the backend has prepared the process (the CPU backend installs its
  megatron-core compatibility layer).
* :func:`cuda_connections_setting` — ``CUDA_DEVICE_MAX_CONNECTIONS=1`` on GPU with TP > 1, set by
  :func:`init_distributed` before CUDA creates its context (the variable is read then). megatron's tensor-parallel
  linear layers (``tensor_parallel/layers.py``) launch the all-gather / reduce-scatter of the input gradient
  asynchronously and then the weight-gradient GEMM, relying on the GPU to start kernels in the order they were
  issued so that the communication overlaps the GEMM; one hardware work queue is what guarantees that order.
* :func:`init_distributed` — torch.distributed + megatron ``parallel_state`` with the TP/PP layout; DP is what is
  left of the world, and a mixture-of-experts model's experts are split over EP of those DP ranks (megatron's
  ``expert_model_parallel_size``; EP must divide DP). A world that is not TP×PP×DP, an EP that does not divide DP,
  or a rendezvous port already taken, is a clear error up front. Each restart of a launcher (torchrun
  ``--max-restarts``) rendezvouses in keys of its own.
* :func:`set_collective_timeout` — how long a collective of any training process group (the default group and every
  group megatron made) may wait: the trainer raises it for what is legitimately slow (the first step, a checkpoint)
  and lowers it again after. Megatron makes its groups with a timeout of its own (30 minutes unless told), so a
  stopped rank left its peers waiting that long in the expert all-to-all or the gradient all-reduce whatever
  ``parallel.collective_timeout_s`` said; :func:`init_distributed` gives them the one it is passed.
* :func:`flight_recorder_env` — on NCCL, torch's flight recorder: the last collectives of every rank are dumped to the
  run directory when NCCL's watchdog times one out (what stalled where, for ``torch.distributed.flight_recorder``).
* :func:`seed_everything` — every generator, the same on every rank (megatron's CPU-initialized weights are drawn from
  the CPU generator on every rank and then sliced, so they must agree).
"""

from __future__ import annotations

import datetime
import math
import os
import random
import socket
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import numpy as np
import torch

from dapo_megatron.host_address import pin_gloo_interface
from dapo_megatron.launch_env import LaunchEnv, LaunchError, launch_env

if TYPE_CHECKING:
    from dapo_megatron.backend.base import Backend


@dataclass(frozen=True)
class DeviceInfo:
    device: torch.device
    collective: str  # "nccl" or "gloo"


def cuda_device_index(local_rank: int, device_count: int) -> int:
    """This process's GPU: its local rank modulo the GPUs it sees (all of the node's, or the one SLURM bound to it)."""
    if device_count < 1:
        raise LaunchError("CUDA is available but reports no visible GPU (check CUDA_VISIBLE_DEVICES)")
    return local_rank % device_count


def prepare_device(backend: "Backend", local_rank: int = 0, *, device_count: int | None = None) -> DeviceInfo:
    """This process's device and collective backend on ``backend``'s platform, the process prepared for it.

    ``device_count`` (default ``torch.cuda.device_count()``) is only for tests of the decision.
    """
    backend.prepare_process()
    if backend.device_type == "cuda":
        index = cuda_device_index(local_rank, torch.cuda.device_count() if device_count is None else device_count)
        torch.cuda.set_device(index)
        return DeviceInfo(torch.device("cuda", index), backend.collective)
    return DeviceInfo(torch.device("cpu"), backend.collective)


CUDA_CONNECTIONS_VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"


def cuda_connections_setting(tensor_parallel: int, *, cuda_available: bool) -> str | None:
    """The value ``CUDA_DEVICE_MAX_CONNECTIONS`` needs before CUDA starts (None: leave it alone): "1" on GPU with
    TP > 1, where megatron's tensor-parallel layers overlap their collectives with GEMMs (see the module docstring)."""
    return "1" if cuda_available and tensor_parallel > 1 else None


def apply_cuda_connections(tensor_parallel: int, *, environ: dict | None = None,
                           cuda_available: bool | None = None) -> str | None:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS`` as :func:`cuda_connections_setting` says, unless the user chose a value
    (kept, with a warning) or CUDA is already initialized (too late: a warning). Returns the value now in force."""
    env = os.environ if environ is None else environ
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    wanted = cuda_connections_setting(tensor_parallel, cuda_available=cuda_available)
    current = env.get(CUDA_CONNECTIONS_VARIABLE)
    if wanted is None or current == wanted:
        return current
    if current is not None:
        warnings.warn(f"{CUDA_CONNECTIONS_VARIABLE}={current} is kept as set; megatron's tensor-parallel layers "
                      f"overlap communication with computation only with {wanted}", stacklevel=2)
        return current
    if cuda_available and torch.cuda.is_initialized():
        warnings.warn(f"CUDA was initialized before {CUDA_CONNECTIONS_VARIABLE} could be set to {wanted}: set it in "
                      f"the launch environment", stacklevel=2)
    env[CUDA_CONNECTIONS_VARIABLE] = wanted
    return wanted


@dataclass(frozen=True)
class ParallelLayout:
    rank: int
    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    device: DeviceInfo
    backend: "Backend"
    expert_parallel: int = 1


def resolve_data_parallel(world_size: int, tensor_parallel: int, pipeline_parallel: int,
                          data_parallel: int | None = None, expert_parallel: int = 1) -> int:
    """DP = world / (TP×PP); a given DP must agree, and EP must divide it. Raises :class:`LaunchError` naming the
    numbers otherwise."""
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise LaunchError(f"tensor_parallel ({tensor_parallel}) and pipeline_parallel ({pipeline_parallel}) "
                          "must be >= 1")
    model_parallel = tensor_parallel * pipeline_parallel
    if world_size % model_parallel:
        raise LaunchError(
            f"world size {world_size} is not divisible by tensor_parallel × pipeline_parallel = "
            f"{tensor_parallel} × {pipeline_parallel} = {model_parallel}"
        )
    derived = world_size // model_parallel
    if data_parallel is not None and data_parallel != derived:
        raise LaunchError(
            f"world size {world_size} != tensor_parallel × pipeline_parallel × data_parallel = "
            f"{tensor_parallel} × {pipeline_parallel} × {data_parallel} = {model_parallel * data_parallel}"
        )
    if expert_parallel < 1 or derived % expert_parallel:
        raise LaunchError(
            f"expert_parallel={expert_parallel} must divide the data-parallel size {derived} (world {world_size} / "
            f"(tensor_parallel {tensor_parallel} × pipeline_parallel {pipeline_parallel})): the experts are split "
            f"over data-parallel ranks"
        )
    return derived


def _check_port_free(addr: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("" if addr not in ("127.0.0.1", "localhost") else addr, port))
        except OSError as exc:
            raise LaunchError(
                f"rendezvous port {port} on {addr} is already in use ({exc.strerror}); "
                f"set MASTER_PORT to a free port"
            ) from None


def init_distributed(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    data_parallel: int | None = None,
    *,
    expert_parallel: int = 1,
    backend: "Backend | None" = None,
    environ: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
) -> ParallelLayout:
    """Initialize torch.distributed and megatron ``parallel_state`` for this process, on ``backend``'s platform
    (default: :func:`dapo_megatron.backend_registry.select_backend` with ``model.kernels: auto``); ``expert_parallel``
    ranks share a MoE model's experts.

    Idempotent for the same layout in one process (a second call returns the layout already set up).
    """
    # Not at the top: megatron-core and the backends take seconds to import, and the helpers above are read by
    # commands and tests that never train.
    from megatron.core import parallel_state

    from dapo_megatron.backend_registry import select_backend

    env = launch_env(environ)
    dp = resolve_data_parallel(env.world_size, tensor_parallel, pipeline_parallel, data_parallel, expert_parallel)
    backend = select_backend() if backend is None else backend
    apply_cuda_connections(tensor_parallel)  # before prepare_device: binding the GPU may create the CUDA context
    device = prepare_device(backend, env.local_rank)

    if not torch.distributed.is_initialized():
        # Ranks on other nodes must reach this one's gloo address (gloo carries the CPU collectives, and megatron
        # makes gloo groups next to NCCL ones on GPUs too); the host name may resolve to loopback, or to nothing.
        pin_gloo_interface(env.master_addr)
        if env.rank == 0 and env.launcher != "torchrun":
            # torchrun's agent already owns the store port; anywhere else rank 0 binds it, so check it first:
            # a taken port otherwise surfaces as a hang on the other ranks.
            _check_port_free(env.master_addr, env.master_port)
        timeout = datetime.timedelta(seconds=timeout_s)
        torch.distributed.init_process_group(backend=device.collective, store=rendezvous_store(env, timeout),
                                             rank=env.rank, world_size=env.world_size, timeout=timeout)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            expert_model_parallel_size=expert_parallel,
            distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),  # whole minutes: made exact just below
        )
        set_collective_timeout(timeout_s)
    elif (parallel_state.get_tensor_model_parallel_world_size() != tensor_parallel
          or parallel_state.get_pipeline_model_parallel_world_size() != pipeline_parallel
          or parallel_state.get_expert_model_parallel_world_size() != expert_parallel):
        raise LaunchError("megatron parallel_state is already initialized with a different TP/PP/EP layout")
    return ParallelLayout(env.rank, env.world_size, tensor_parallel, pipeline_parallel, dp, device, backend,
                          expert_parallel)


def rendezvous_store(env: LaunchEnv, timeout: datetime.timedelta):
    """The job's store (torch's ``tcp://`` rendezvous at MASTER_ADDR:MASTER_PORT: torchrun's agent's, or the one rank 0
    hosts), seen through keys of this start's own: torchrun's agent keeps one store across the restarts of
    ``--max-restarts``, and the ranks of a restart read the gloo addresses of the attempt before (connectFullMesh
    failed: connection refused) when a peer had not yet written its new one."""
    store, _, _ = next(torch.distributed.rendezvous(
        f"tcp://{env.master_addr}:{env.master_port}?rank={env.rank}&world_size={env.world_size}", timeout=timeout))
    return torch.distributed.PrefixStore(f"dapo/attempt_{env.restart_count}", store)


def set_collective_timeout(seconds: float) -> None:
    """The timeout of every training process group: the default group and megatron's (not rank_zero's waiting
    group). A collective itself (megatron-core's ``update_pg_timeout``: a barrier, then the new limit on every group it
    made and on the default one), so every rank calls it at the same point; nothing without a process group."""
    from megatron.core import parallel_state  # import cost: see init_distributed

    if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized():
        parallel_state.update_pg_timeout(datetime.timedelta(seconds=seconds))


FLIGHT_RECORDER_DIR = "nccl_flight_recorder"
FLIGHT_RECORDER_FILE_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"  # torch's: a path prefix, the rank appended


def flight_recorder_env(run_dir: str | os.PathLike, collective: str,
                        environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that turn on torch's NCCL flight recorder for this process (empty off NCCL): a ring of the last
    2000 collectives per rank, dumped on a watchdog timeout to ``<run_dir>/nccl_flight_recorder/rank_<N>``. Only
    variables the user has not set; set before the first NCCL group (they are read then)."""
    if collective != "nccl":
        return {}
    env = os.environ if environ is None else environ
    wanted = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              FLIGHT_RECORDER_FILE_ENV: os.path.join(os.fspath(run_dir), FLIGHT_RECORDER_DIR, "rank_")}
    return {name: value for name, value in wanted.items() if name not in env}


def destroy_distributed() -> None:
    from megatron.core import parallel_state  # import cost: see init_distributed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy, torch's CPU generator and megatron's model-parallel RNG tracker.

    Every rank passes the same seed: megatron derives the tensor-parallel streams from it by TP rank itself.
    """
    from megatron.core import parallel_state  # import cost: see init_distributed
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if parallel_state.model_parallel_is_initialized():

        model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)  # on CPU the tracker shares this generator; leave it at the plain seed
