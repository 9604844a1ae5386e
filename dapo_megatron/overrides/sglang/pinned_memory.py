"""SGLang 0.5.23's LoRA layers on a CPU-only server: pinned host memory asked for where there is no accelerator.

The defect: with ``--enable-lora`` a CPU server dies at start — ``sglang/srt/lora/layers.py`` (~141, every
``*WithLoRA`` layer) allocates its offsets with ``torch.tensor(..., pin_memory=True)``, and the ``torch_native``
backend pins its batch tensors (``.pin_memory()``); torch raises "pin_memory=True requires a CUDA or other
accelerator backend" on a machine without one. Pinned memory only speeds up host-to-device copies, so where there is
no device the unpinned tensor is the same tensor.

:func:`allow_pin_memory_without_accelerator` makes ``pin_memory=True`` mean unpinned in torch's factories and
``Tensor.pin_memory()`` return the tensor, in the process that calls it and only when torch has no accelerator. It is
applied in SGLang *server* processes on CPU: the ``sgl_kernel`` stand-in that every such process imports
(:mod:`dapo_megatron.cpu.sglang`) loads this file by its path — the server's interpreter need not have dapo-megatron
installed — and calls it. This module imports nothing but torch for that reason. Never applied in the trainer.
"""

from __future__ import annotations

import functools

import torch

PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange")  # what SGLang's LoRA code calls pinned


def _without_pinning(factory):
    @functools.wraps(factory)
    def unpinned(*args, pin_memory: bool = False, **kwargs):
        return factory(*args, **kwargs)

    unpinned.__dapo_unpinned__ = True
    return unpinned


def _same_tensor(self, *args, **kwargs):
    return self


def allow_pin_memory_without_accelerator() -> bool:
    """Make pinning a no-op in this process when torch has no accelerator (see the module docstring); returns
    whether it did. Calling it again changes nothing."""
    if torch.cuda.is_available() or (hasattr(torch, "accelerator") and torch.accelerator.is_available()):
        return False
    for name in PINNING_FACTORIES:
        factory = getattr(torch, name)
        if not getattr(factory, "__dapo_unpinned__", False):
            setattr(torch, name, _without_pinning(factory))
    torch.Tensor.pin_memory = _same_tensor
    return True
