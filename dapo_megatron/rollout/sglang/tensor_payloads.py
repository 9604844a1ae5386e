"""What ``/update_weights_from_tensor`` carries: per server, one serialized bucket per TP rank.

SGLang 0.5.23 (``TpModelWorker.deserialize_own_rank``) has TP rank ``r`` of a server deserialize entry ``r`` of
``serialized_named_tensors`` and nothing else, so a payload holds one entry per TP rank. Two ways to serialize:

* by value — a standard pickle of CPU copies (the server's ``SafeUnpickler`` admits ``torch.storage._load_from_bytes``).
  Works between any hosts. The bytes carry the data and no handle, so every rank's entry is the same pickle.
* by reference — CUDA tensors as CUDA IPC handles (no copy), only for a server TP rank on a GPU that holds the bucket:
  the bucket's own GPU, or one whose trainer rank made a copy of its own and serialized it
  (:class:`~dapo_megatron.hf_format.BucketWithCopies`, :mod:`dapo_megatron.handoff.gpu_copies`; :func:`entry_gpu`).
  Every such rank gets a serialization of its own: torch counts the consumers of a shared CUDA block per
  serialization, and a rank opening another rank's entry would upset that count. The handle
  names its GPU by UUID rather than by index, which is how SGLang's ``monkey_patch_torch_reductions`` (applied by the
  server before it deserializes) finds the GPU when the server's ``CUDA_VISIBLE_DEVICES`` differs from the trainer's.
  The UUID is put in by this module's own pickler for these payloads only
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
from typing import Collection, Protocol, Sequence

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


def bucket_gpu(tensors: Sequence[tuple[str, torch.Tensor]]) -> int | None:
    """The GPU a bucket lives on (the exporter gathers each bucket on one device), None for a CPU bucket."""
    devices = {tensor.device.index for _, tensor in tensors if tensor.is_cuda}
    return devices.pop() if len(devices) == 1 and bucket_on_cuda(tensors) else None


def entry_gpu(bucket_on: int | None, copies: Collection[int], server: "PayloadDestination", rank: int) -> int | None:
    """The GPU whose copy of the bucket TP rank ``rank`` of ``server`` opens by CUDA IPC handle — its own GPU, when
    that GPU holds one (``bucket_on``: the bucket's own; ``copies``: the GPUs with a trainer rank's copy) — or None:
    the rank gets the bucket by value. torch rebuilds an IPC tensor on the producer's GPU (SGLang 0.5.23's UUID patch,
    ``srt/utils/patch_torch.py``, maps the handle back to that GPU), so a rank opening another GPU's handle would
    make a CUDA context there; only ranks on this host with known GPUs (launched here) are considered."""
    if not (server.same_host and server.gpus is not None):
        return None
    gpu = server.gpus[rank]
    return gpu if gpu == bucket_on or gpu in copies else None


def by_value_entries(servers: Sequence["PayloadDestination"], bucket_on: int | None, copies: Collection[int]) -> int:
    """How many server TP ranks a bucket reaches by value (base64 of its bytes through HTTP)."""
    return sum(entry_gpu(bucket_on, copies, server, rank) is None for server in servers
               for rank in range(server.tp_size))


class PayloadDestination(Protocol):
    """What a payload's layout depends on: the server's TP degree (one entry per rank), whether it runs on this
    host, and its ranks' GPUs (None: not known here, an attached server). The transports' ``ServerTarget`` is one."""

    tp_size: int
    same_host: bool
    gpus: range | None


class BucketPayloads:
    """One bucket's ``serialized_named_tensors`` for each server (:meth:`for_server`).

    ``by_reference``: some server got handles into :attr:`tensors` (see the module docstring for how long they live);
    handles of other GPUs' copies (``bucket.copies``) live as long as the ranks that made them keep those.
    """

    def __init__(self, bucket: Bucket, servers: Sequence[PayloadDestination]) -> None:
        self.tensors = [(name, tensor.detach().contiguous()) for name, tensor in bucket]
        copies: dict[int, bytes] = getattr(bucket, "copies", {})
        on_gpu = bucket_gpu(self.tensors)
        self.by_reference = False
        self._per_server: dict[int, list[bytes]] = {}
        by_value = None  # the same object for every rank and server that takes it: the client sends it without copying
        for server in servers:
            entries = []
            for rank in range(server.tp_size):
                gpu = entry_gpu(on_gpu, copies, server, rank)
                if gpu is None:
                    by_value = by_value or serialize_by_value(self.tensors)
                    entries.append(by_value)
                elif gpu == on_gpu:
                    entries.append(serialize_by_reference(self.tensors))
                    self.by_reference = True
                else:
                    entries.append(copies[gpu])
            self._per_server[id(server)] = entries

    def for_server(self, server: PayloadDestination) -> list[bytes]:
        return self._per_server[id(server)]
