"""megatron-core on a machine without CUDA: the device-redirect layer.

megatron-core 0.16 assumes a GPU in ~250 places. This module lets the *real* library (models, Megatron DDP, the
Megatron optimizer, the pipeline schedules, dist_checkpointing) run on CPU over gloo, so that everything around the
GPU-only kernels is exercised on a laptop and in CI. It is installed by the CPU backend's ``prepare_process``
(:class:`dapo_megatron.cpu.backend.CpuBackend`, which :func:`dapo_megatron.platform.prepare_device` calls) once
per process, and only when CUDA is absent; with CUDA it is never installed and changes nothing.

Exactly what it changes, and why:

1. A :class:`torch.overrides.TorchFunctionMode` (:class:`CudaToCpuMode`), entered for the life of the process on
   the thread that installs the layer (torch keeps function modes per thread), that
   - rewrites every ``device=`` keyword argument naming CUDA (``"cuda"``, ``"cuda:0"``, an int index,
     ``torch.device("cuda")``) to ``"cpu"`` — megatron allocates buffers with ``device=torch.cuda.current_device()``
     or ``device="cuda"`` (DDP grad buffers, optimizer state, grad-norm accumulators);
   - makes ``Tensor.cuda()`` return the tensor itself and ``Tensor.to(<cuda device>)`` target the CPU;
   - makes a bare ``Tensor.type()`` report the CUDA type name (``torch.FloatTensor`` → ``torch.cuda.FloatTensor``)
     because ``clip_grads`` and the distributed optimizer filter parameters with
     ``param.type() == "torch.cuda.FloatTensor"`` and would otherwise silently skip every parameter.

   A mode sees every torch call on its thread (tens of thousands per training step), so its handler starts with a
   fast path: a call with no ``device`` keyword to anything but ``Tensor.cuda`` / ``Tensor.type`` / ``Tensor.to``
   has nothing to rewrite and is passed straight through. Code that never names CUDA (the embedded engine's HF
   generation) can also run without the mode at all, inside :func:`suspended`: what remains of the cost is torch
   dispatching each call to a Python handler, which only taking the mode off the stack removes.
2. ``torch.cuda.current_device()`` returns ``"cpu"`` (so ``device=torch.cuda.current_device()`` lands on the CPU),
   ``torch.cuda.synchronize()`` does nothing, ``torch.cuda.device_count()`` returns 1.
   ``torch.cuda.is_available()`` is left untouched (False), so code that asks honestly gets the truth.
3. The CUDA RNG used by megatron's model-parallel RNG tracker (``tensor_parallel.random._get_cuda_rng_state`` /
   ``_set_cuda_rng_state`` and ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` /
   ``manual_seed_all``) is mapped onto the CPU default generator, so the tracker's fork/restore semantics hold
   (tensor-parallel regions draw from their own stream) and checkpoints can save and restore it.

4. megatron's activation-recomputation checkpoint (``tensor_parallel.random.CheckpointFunction``, used by both
   selective and full recomputation) re-runs the forward inside its ``backward``, which autograd's engine calls
   without this thread's function-mode stack: its ``backward`` is wrapped to run under a :class:`CudaToCpuMode`
   when none is active (the recomputed attention would otherwise allocate its causal mask with ``device="cuda"``).

5. CUDA streams and events: megatron's MoE all-to-all token dispatcher copies its routing counts to the host on a
   side stream (``torch.cuda.Stream()`` at construction, ``torch.cuda.stream(...)``, ``wait_stream``,
   ``record_event().synchronize()``). On the CPU every operation is complete when it returns, so
   ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` become a :class:`HostStream` with nothing to order and
   a :class:`HostEvent` that is always complete.

6. The same dispatcher turns its split sizes into NumPy arrays for ``all_to_all_single`` while moving them to the
   host (``maybe_move_tensor_to_cpu(..., as_numpy=True)``), which only does anything to CUDA tensors: on the CPU
   the sizes stayed tensors, which gloo's ``all_to_all_single`` refuses. The dispatcher's copy of that function
   (:func:`_host_counts`) also converts CPU tensors.

Nothing else is touched: no megatron source is edited, no numerics change (the CPU kernels megatron falls back to
when Transformer Engine and apex are absent are its own torch implementations).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer.moe import token_dispatcher
from torch.overrides import (
    TorchFunctionMode,
    _get_current_function_mode,
    _get_current_function_mode_stack,
    _pop_mode_temporarily,
)

_install_lock = threading.Lock()
_installed_mode: "CudaToCpuMode | None" = None


def _names_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    # A bare int index means "that CUDA device" to torch's factory functions. bool is an int too: exclude it.
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_TYPE = torch.Tensor.type
_TENSOR_TO = torch.Tensor.to


class CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA placements to the CPU (see the module docstring, point 1)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Fast path (nearly every call): no device keyword and none of the three methods _redirect handles.
        if (not kwargs or "device" not in kwargs) and not (
                func is _TENSOR_CUDA or func is _TENSOR_TYPE or func is _TENSOR_TO):
            return func(*args, **kwargs) if kwargs else func(*args)
        return self._redirect(func, args, kwargs or {})

    @staticmethod
    def _redirect(func, args, kwargs):
        if func is _TENSOR_CUDA:
            return args[0]
        if func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs and _names_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is _TENSOR_TO and len(args) > 1 and _names_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cpu_rng_get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_rng_set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_rng_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


class HostEvent:
    """A CUDA event stand-in on the CPU: the work before it is already done (point 5)."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream: "HostStream | None" = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True


class HostStream:
    """A CUDA stream stand-in on the CPU: operations run in program order, so there is nothing to order (point 5)."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream: "HostStream") -> None:
        """Everything issued on ``stream`` has already run."""

    def wait_event(self, event: HostEvent) -> None:
        """The event's work has already run."""

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        return event or HostEvent()

    def synchronize(self) -> None:
        """Nothing to wait for."""


_HOST_STREAM = HostStream()


def _host_counts(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's ``maybe_move_tensor_to_cpu`` for tensors already on the host (point 6): a NumPy copy when asked."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy().copy()
    return tensor


def _mode_active() -> bool:
    return any(isinstance(mode, CudaToCpuMode) for mode in _get_current_function_mode_stack())


def _with_redirect(backward):
    """``backward`` run under the device redirect (point 4), entered only when it is not already on the stack."""

    def redirected_backward(ctx, *grads):
        if _mode_active():
            return backward(ctx, *grads)
        with CudaToCpuMode():
            return backward(ctx, *grads)

    redirected_backward.__wrapped__ = backward
    return redirected_backward


def install() -> bool:
    """Install the layer in this process. Returns True the first time, False when already installed."""
    global _installed_mode
    with _install_lock:
        if _installed_mode is not None:
            return False

        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.device_count = lambda: 1
        torch.cuda.get_rng_state = _cpu_rng_get_state
        torch.cuda.set_rng_state = _cpu_rng_set_state
        # Not torch.manual_seed: that one calls torch.cuda.manual_seed_all itself.
        torch.cuda.manual_seed = _cpu_rng_manual_seed
        torch.cuda.manual_seed_all = _cpu_rng_manual_seed
        torch.cuda.Stream = HostStream
        torch.cuda.current_stream = lambda device=None: _HOST_STREAM
        torch.cuda.stream = lambda stream=None: nullcontext()
        token_dispatcher.maybe_move_tensor_to_cpu = _host_counts
        megatron_random._get_cuda_rng_state = _cpu_rng_get_state
        megatron_random._set_cuda_rng_state = _cpu_rng_set_state
        checkpoint_function = megatron_random.CheckpointFunction
        checkpoint_function.backward = staticmethod(_with_redirect(checkpoint_function.backward))

        mode = CudaToCpuMode()
        # Entered for the life of the process on purpose: megatron reaches for CUDA from many call sites,
        # and a scoped context would miss the ones that run later (optimizer steps, checkpoint loads).
        mode.__enter__()
        _installed_mode = mode
        return True


def is_installed() -> bool:
    return _installed_mode is not None


def installed_mode() -> "CudaToCpuMode | None":
    """The redirect mode this process entered at :func:`install` (None before): the one that must be current outside
    a :func:`suspended` block."""
    return _installed_mode


@contextmanager
def suspended() -> Iterator[None]:
    """Run the block without the device redirect (point 1), for code that never names CUDA.

    A no-op when the layer is not installed, on another thread than the one that installed it, or when another
    torch function mode was entered on top of it (taking it off from under that mode would reorder the stack):
    there the redirect simply stays on, which is always correct. Points 2 and 3 are plain attribute patches with
    no per-call cost and stay as they are.
    """
    mode = _installed_mode
    if mode is None or _get_current_function_mode() is not mode:
        yield
        return
    with _pop_mode_temporarily():
        yield
