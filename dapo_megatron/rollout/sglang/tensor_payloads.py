"""What ``/update_weights_from_tensor`` carries: per server, one serialized bucket per TP rank.

SGLang 0.5.23 (``TpModelWorker.deserialize_own_rank``) has TP rank ``r`` of a server deserialize entry ``r`` of
``serialized_named_tensors`` and nothing else, so a payload holds one entry per TP rank. Two ways to serialize:

* by value — a standard pickle of CPU copies (the server's ``SafeUnpickler`` admits ``torch.storage._load_from_bytes``).
  Works between any hosts. The bytes carry the data and no handle, so every rank's entry is the same pickle.
* by reference — CUDA tensors as CUDA IPC handles (no copy), only for a server on this host and a bucket that lives
  on GPUs. Every TP rank gets a serialization of its own: torch counts the consumers of a shared CUDA block per
  serialization, and a rank opening another rank's entry would upset that count. The handle names its GPU by
  UUID rather than by index, which is how SGLang's ``monkey_patch_torch_reductions`` (applied by the server before it
  deserializes) finds the GPU when the server's ``CUDA_VISIBLE_DEVICES`` differs from the trainer's. The UUID is put
  in by this module's own pickler for these payloads only
  (:func:`dapo_megatron.overrides.sglang.ipc_handles.reduce_naming_uuid`); torch's reducers stay untouched in the
  trainer, where a global patch would also rewrite CPU tensors' reductions. Servers load (enqueue their copies from)
  that memory before they answer, and torch keeps a block a consumer still holds in its IPC limbo when this process
  drops it, so the transport drops :attr:`BucketPayloads.tensors` a few buckets after the answers
  (:class:`dapo_megatron.rollout.sglang.transports.HandleWindow`).

CPU tensors are never sent as shared-memory handles: with torch's default ``file_descriptor`` strategy the server
crashes (it fetches the fd from this process's resource sharer, which rejects the server's authkey), and the
``file_system`` strategy starts a ``torch_shm_manager`` that keeps the client's stdout open (a piped CI step then hangs)
and can leave files in ``/dev/shm``. The by-reference path has not run on a GPU in this project yet.
"""

from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Protocol, Sequence

import torch

from dapo_megatron.hf_format import Bucket
from dapo_megatron.overrides.sglang.ipc_handles import reduce_naming_uuid


def serialize_by_value(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """Base64 (ASCII bytes) of a standard pickle of CPU copies of the tensors. The copies go before the base64 is
    made: at most the pickle and the copies (2× the bucket) or the pickle and its base64 (2.3×) are alive at once,
    the base64 (1.3×) after."""
    pickled = pickle.dumps([(name, tensor.detach().cpu().contiguous()) for name, tensor in named_tensors],
                           protocol=pickle.HIGHEST_PROTOCOL)
    return base64.b64encode(pickled)


def serialize_by_reference(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """Base64 (ASCII bytes) of a ``ForkingPickler`` pickle of CUDA tensors: IPC handles whose GPU is named by UUID."""
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[torch.Tensor] = reduce_naming_uuid
    pickler.dump(list(named_tensors))
    return base64.b64encode(buffer.getvalue())


def bucket_on_cuda(tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
    return all(tensor.is_cuda for _, tensor in tensors)


def sends_by_reference(on_cuda: bool, same_host: bool) -> bool:
    """CUDA IPC handles only for a bucket on GPUs going to a server on this host; everything else goes by value."""
    return on_cuda and same_host


class PayloadDestination(Protocol):
    """What a payload's layout depends on: the server's TP degree (one entry per rank) and whether it runs on this
    host (CUDA handles are meaningful there only). The transports' ``ServerTarget`` is one."""

    tp_size: int
    same_host: bool


class BucketPayloads:
    """One bucket's ``serialized_named_tensors`` for each server (:meth:`for_server`).

    ``by_reference``: some server got handles into :attr:`tensors` (see the module docstring for how long they live).
    """

    def __init__(self, bucket: Bucket, servers: Sequence[PayloadDestination]) -> None:
        self.tensors = [(name, tensor.detach().contiguous()) for name, tensor in bucket]
        on_cuda = bucket_on_cuda(self.tensors)
        self.by_reference = False
        self._per_server: dict[int, list[bytes]] = {}
        by_value = None
        for server in servers:
            if sends_by_reference(on_cuda, server.same_host):
                self._per_server[id(server)] = [serialize_by_reference(self.tensors) for _ in range(server.tp_size)]
                self.by_reference = True
            else:  # the same object for every rank and server: the client sends it without copying
                by_value = by_value or serialize_by_value(self.tensors)
                self._per_server[id(server)] = [by_value] * server.tp_size

    def for_server(self, server: PayloadDestination) -> list[bytes]:
        return self._per_server[id(server)]
