"""CUDA IPC handles that name their GPU by UUID, the way an SGLang 0.5.23 server reads them, made in the trainer
without SGLang's global patch of torch.

torch (pytorch/pytorch#149248, open at 2.13) puts the GPU's *index* in a CUDA tensor's IPC handle, which means
another GPU in a process whose ``CUDA_VISIBLE_DEVICES`` differs. SGLang 0.5.23's ``monkey_patch_torch_reductions``
(``srt/utils/patch_torch.py``, applied by its TP workers before they deserialize) replaces torch's reducers process-
wide so that handles carry the GPU's UUID, and its rebuild accepts either. The trainer must write UUIDs too, but only
into the weight-update payloads (:mod:`dapo_megatron.rollout.sglang.tensor_payloads`): :func:`reduce_naming_uuid`
is the reducer for that one pickler, built on torch's own reducer — :data:`torch_reduce_tensor`, which undoes
SGLang's patch should something in this process have applied it (it keeps torch's reducers as ``*_original``).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch.multiprocessing import reductions

# torch's reducers, even if SGLang's patch replaced them in this process (then they already write UUIDs).
torch_reduce_tensor = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
torch_rebuild_cuda_tensor = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
# Where the GPU index sits in the arguments torch's reducer gives ``rebuild_cuda_tensor``.
DEVICE_ARGUMENT = list(inspect.signature(torch_rebuild_cuda_tensor).parameters).index("storage_device")


def reduce_naming_uuid(tensor: torch.Tensor):
    """torch's reduction of a CUDA tensor, its GPU named by UUID (a pickler's ``dispatch_table`` entry)."""
    if not tensor.is_cuda:
        raise ValueError("serialize_by_reference: only CUDA tensors travel as handles (CPU ones go by value)")
    rebuild, arguments = torch_reduce_tensor(tensor)
    return rebuild, with_device_uuid(arguments, _device_uuid)


def with_device_uuid(arguments: tuple, uuid_of: Callable[[int], str]) -> tuple:
    """torch's ``rebuild_cuda_tensor`` arguments with the GPU index replaced by ``uuid_of(index)``."""
    index = arguments[DEVICE_ARGUMENT]
    if isinstance(index, str):  # already a UUID (SGLang's patch is active in this process)
        return arguments
    return (*arguments[:DEVICE_ARGUMENT], uuid_of(index), *arguments[DEVICE_ARGUMENT + 1:])


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)
