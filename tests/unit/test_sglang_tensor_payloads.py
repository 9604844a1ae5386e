"""The tensor transport's payloads, decided on CPU: one entry per server TP rank, CUDA IPC handles only for GPU buckets
going to a server on this host (each TP rank its own serialization, the GPU named by UUID), CPU copies by value
otherwise, and a bucket sent by reference kept alive until ``/end_weight_update`` returned.

No GPU here: the device flag and the IPC serializer are stood in for where the CUDA path would run; the real CPU
server path is ``tests/integration/test_sglang_server.py``'s tensor-transport test."""

from __future__ import annotations

import base64
import gc
import importlib.util
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import textwrap
import threading
import tracemalloc
import weakref
from pathlib import Path

import pytest
import torch

from dapo_megatron.overrides.sglang.ipc_handles import DEVICE_ARGUMENT, with_device_uuid
from dapo_megatron.rollout.sglang import tensor_payloads
from dapo_megatron.rollout.sglang.client import SGLangClient, tensor_update_body
from dapo_megatron.rollout.sglang.tensor_payloads import BucketPayloads, serialize_by_reference
from dapo_megatron.rollout.sglang.transports import IPC_WINDOW_BUCKETS, ServerTarget, TensorTransport

REPO_ROOT = Path(__file__).resolve().parents[2]

torch.set_num_threads(1)


class RecordingClient:
    """The calls a transport makes on one server, in order; ``at_end`` runs when ``/end_weight_update`` arrives."""

    def __init__(self, name: str, at_end=lambda: None) -> None:
        self.base_url = name
        self.calls: list[tuple] = []
        self.at_end = at_end

    def begin_weight_update(self):
        self.calls.append(("begin",))

    def update_weights_from_tensor(self, payloads, *, version, flush_cache):
        self.calls.append(("tensor", list(payloads)))

    def end_weight_update(self):
        self.calls.append(("end", self.at_end()))

    def flush_cache(self):
        self.calls.append(("flush",))

    def set_weight_version(self, version):
        self.calls.append(("version", version))


def _bucket(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(f"layer{seed}.weight", torch.randn(3, 4, generator=generator)),
            (f"layer{seed}.bias", torch.randn(4, generator=generator).to(torch.bfloat16))]


def _unpickled(payload: str) -> list[tuple[str, torch.Tensor]]:
    return pickle.loads(base64.b64decode(payload))


def _equal(a, b) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


@pytest.fixture
def fake_cuda(monkeypatch):
    """Buckets count as living on GPUs; the IPC serializer records what it was given and gives each call its own
    payload (as every real serialization is its own set of handles)."""
    made = []

    def by_reference(tensors):
        made.append([weakref.ref(t) for _, t in tensors])
        return f"handles-{len(made)}"

    monkeypatch.setattr(tensor_payloads, "bucket_gpu", lambda tensors: 0)  # the bucket lives on GPU 0
    monkeypatch.setattr(tensor_payloads, "serialize_by_reference", by_reference)
    return made


@pytest.fixture
def handles_to_every_rank(fake_cuda, monkeypatch):
    """As fake_cuda, and every rank takes handles (as if each sat on the bucket's GPU): the window's bookkeeping does
    not depend on which ranks those are."""
    monkeypatch.setattr(tensor_payloads, "entry_gpu", lambda bucket_on, copies, server, rank: bucket_on)
    return fake_cuda


def test_every_tp_rank_gets_an_entry_holding_the_whole_bucket():
    bucket = _bucket()
    servers = [ServerTarget(RecordingClient("a"), tp_size=2, same_host=True),
               ServerTarget(RecordingClient("b"), tp_size=3, same_host=False)]
    payloads = BucketPayloads(bucket, servers)
    assert [len(payloads.for_server(s)) for s in servers] == [2, 3]
    for server in servers:
        for entry in payloads.for_server(server):
            assert _equal(_unpickled(entry), bucket)  # a CPU bucket goes by value, to every server
    assert not payloads.by_reference


def test_a_gpu_bucket_goes_as_handles_only_to_server_ranks_on_its_own_gpu(fake_cuda):
    local = ServerTarget(RecordingClient("local"), tp_size=2, same_host=True, gpus=range(0, 2))
    also_on_gpu_0 = ServerTarget(RecordingClient("also"), tp_size=1, same_host=True, gpus=range(0, 1))
    remote = ServerTarget(RecordingClient("remote"), tp_size=2, same_host=False, gpus=range(0, 2))
    bucket = _bucket()
    payloads = BucketPayloads(bucket, [local, also_on_gpu_0, remote])
    assert payloads.by_reference
    assert payloads.for_server(local)[0] == "handles-1"  # rank 0 is on the bucket's GPU
    assert _equal(_unpickled(payloads.for_server(local)[1]), bucket)  # rank 1 (GPU 1) by value: no context on GPU 0
    assert payloads.for_server(also_on_gpu_0) == ["handles-2"]  # one serialization per rank that gets handles
    assert len(fake_cuda) == 2
    assert all(_equal(_unpickled(entry), bucket) for entry in payloads.for_server(remote))  # by value elsewhere
    only_remote = BucketPayloads(bucket, [remote])
    assert not only_remote.by_reference and len(fake_cuda) == 2


def test_handles_name_the_gpu_by_uuid():
    arguments = tuple(f"arg{i}" for i in range(15))
    arguments = (*arguments[:DEVICE_ARGUMENT], 3, *arguments[DEVICE_ARGUMENT + 1:])
    rewritten = with_device_uuid(arguments, lambda index: f"GPU-uuid-of-{index}")
    assert rewritten[DEVICE_ARGUMENT] == "GPU-uuid-of-3"
    assert rewritten[:DEVICE_ARGUMENT] == arguments[:DEVICE_ARGUMENT]
    assert rewritten[DEVICE_ARGUMENT + 1:] == arguments[DEVICE_ARGUMENT + 1:]
    assert with_device_uuid(rewritten, lambda index: pytest.fail("rewritten twice")) == rewritten


def test_the_uuid_goes_where_torch_and_sglang_expect_the_device():
    import inspect

    from torch.multiprocessing import reductions

    rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    assert list(inspect.signature(rebuild).parameters)[DEVICE_ARGUMENT] == "storage_device"
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("SGLang is not installed in this interpreter")
    patch = Path(spec.origin).parent / "srt" / "utils" / "patch_torch.py"  # read, not imported: importing is slow
    (sglang_index,) = re.findall(r"^_REDUCE_TENSOR_ARG_DEVICE_INDEX = (\d+)$", patch.read_text(), re.MULTILINE)
    assert int(sglang_index) == DEVICE_ARGUMENT


def test_can_the_uuid_handles_go():
    """dapo_megatron.overrides.sglang.ipc_handles, "can it go?": SGLang 0.5.23's TP worker still patches torch's
    reducers to read a handle's GPU as a UUID (pytorch/pytorch#149248 unfixed); when it stops, torch names GPUs the
    way the server reads them and the trainer's UUID pickler can go."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("SGLang is not installed in this interpreter")
    srt = Path(spec.origin).parent / "srt"
    worker = (srt / "managers" / "tp_worker.py").read_text()  # read, not imported: importing is slow
    assert re.search(r"^\s+monkey_patch_torch_reductions\(\)$", worker, re.MULTILINE), (
        "SGLang's TP worker no longer patches torch's reductions: reduce_naming_uuid (and DEVICE_ARGUMENT) can go")


def test_torch_reducers_are_torchs_own_where_sglangs_patch_is_active():
    """SGLang's patch replaces torch's reducers for the whole process; ipc_handles builds on torch's own even then
    (control: the patched ``reductions.reduce_tensor`` is not torch's)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed in this interpreter")
    code = textwrap.dedent("""
        from torch.multiprocessing import reductions
        torch_reduce, torch_rebuild = reductions.reduce_tensor, reductions.rebuild_cuda_tensor
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        monkey_patch_torch_reductions()
        assert reductions.reduce_tensor is not torch_reduce  # the control: SGLang's patch is in force
        from dapo_megatron.overrides.sglang import ipc_handles
        assert ipc_handles.torch_reduce_tensor is torch_reduce
        assert ipc_handles.torch_rebuild_cuda_tensor is torch_rebuild
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_cpu_tensors_never_travel_as_handles():
    with pytest.raises(ValueError, match="only CUDA tensors travel as handles"):
        serialize_by_reference(_bucket())


def _push(servers, buckets, collect=lambda: None):
    TensorTransport(collect=collect).send(servers, iter(buckets), version=5)


def _alive_buckets(made) -> list[int]:
    """Which serializations (in the order made) still have a tensor alive."""
    gc.collect()
    return [i for i, refs in enumerate(made) if any(ref() is not None for ref in refs)]


def test_buckets_sent_as_handles_are_dropped_a_window_behind_and_collected(handles_to_every_rank):
    """Issue 26, item 3: a GPU bucket is held while the servers load it and for IPC_WINDOW_BUCKETS buckets after,
    then dropped and torch.cuda.ipc_collect'ed — the whole model is never held until /end_weight_update."""
    collected = []
    client = RecordingClient("local", at_end=lambda: _alive_buckets(handles_to_every_rank))
    original = client.update_weights_from_tensor

    def upload(payloads, **kwargs):  # what is alive while a bucket's post runs
        client.calls.append(("alive", _alive_buckets(handles_to_every_rank)))
        original(payloads, **kwargs)

    client.update_weights_from_tensor = upload
    _push([ServerTarget(client, tp_size=2, same_host=True)], [_bucket(i) for i in range(6)],
          collect=lambda: collected.append(_alive_buckets(handles_to_every_rank)))
    alive_at_post = [call[1] for call in client.calls if call[0] == "alive"]
    window = IPC_WINDOW_BUCKETS * 2  # serializations: 2 TP ranks per bucket
    for number, alive in enumerate(alive_at_post):
        current = list(range(2 * number, 2 * number + 2))
        assert alive == list(range(max(0, 2 * number - window), 2 * number)) + current, (number, alive)
    ((_, alive_at_end),) = [call for call in client.calls if call[0] == "end"]
    assert alive_at_end == list(range(12 - window, 12))  # the window, not the model
    assert len(collected) == 6 - IPC_WINDOW_BUCKETS + 1 and collected[-1] == []  # after every drop, and at the end
    assert _alive_buckets(handles_to_every_rank) == []
    assert [call[0] for call in client.calls if call[0] != "alive"] == ["begin"] + ["tensor"] * 6 + [
        "end", "flush", "version"]


def test_control_without_the_window_every_bucket_would_still_be_alive_at_the_end(handles_to_every_rank):
    """The check above tells a window from holding everything: with a window as long as the push, all are alive."""
    client = RecordingClient("local", at_end=lambda: _alive_buckets(handles_to_every_rank))
    TensorTransport(ipc_window_buckets=6, collect=lambda: None).send(
        [ServerTarget(client, tp_size=2, same_host=True)], iter([_bucket(i) for i in range(6)]), version=5)
    ((_, alive_at_end),) = [call for call in client.calls if call[0] == "end"]
    assert alive_at_end == list(range(12))


def test_control_a_bucket_sent_by_value_is_not_held(monkeypatch):
    """The check above tells held buckets from released ones: by value, the earlier buckets are gone at the end."""
    sent = []
    real = tensor_payloads.serialize_by_value

    def by_value(tensors):
        sent.append([weakref.ref(t) for _, t in tensors])
        return real(tensors)

    monkeypatch.setattr(tensor_payloads, "serialize_by_value", by_value)

    def alive():
        gc.collect()
        return [any(ref() is not None for ref in refs) for refs in sent]

    client = RecordingClient("remote", at_end=alive)
    _push([ServerTarget(client, tp_size=2, same_host=False)], [_bucket(i) for i in range(3)])
    ((_, alive_at_end),) = [call for call in client.calls if call[0] == "end"]
    assert alive_at_end == [False, False, False]


# ------------------------------------------------------------------ by-value bodies (issue 26, item 4)


class BodySink:
    """An HTTP server on 127.0.0.1 that writes each request body to a file through one preallocated buffer (so it
    allocates nothing per byte: the client's allocations are what tracemalloc sees) and answers success."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.bodies: list[Path] = []
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._buffer = bytearray(1 << 16)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            with connection:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += connection.recv(1024)
                head, first = head.split(b"\r\n\r\n", 1)
                (length,) = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                             if line.lower().startswith(b"content-length:")]
                path = self.directory / f"body{len(self.bodies)}.json"
                view = memoryview(self._buffer)
                with open(path, "wb") as out:
                    out.write(first)
                    remaining = length - len(first)
                    while remaining:
                        got = connection.recv_into(view[:min(remaining, len(view))])
                        out.write(view[:got])
                        remaining -= got
                self.bodies.append(path)
                reply = b'{"success": true}'
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                   + str(len(reply)).encode() + b"\r\nConnection: close\r\n\r\n" + reply)

    def close(self) -> None:
        self._socket.close()


def test_a_by_value_body_is_sent_without_copies_of_the_bucket(tmp_path):
    """A TP-4 server's body holds the bucket's base64 four times; the client must not build it: json.dumps + encode
    made two copies per rank (8 × the payload), for every server posted to at once."""
    bucket = [("big.weight", torch.randn(1 << 21, generator=torch.Generator().manual_seed(0)))]  # 8 MiB of float32
    server = ServerTarget(None, tp_size=4, same_host=False)
    entries = BucketPayloads(bucket, [server]).for_server(server)
    payload_bytes = len(entries[0])
    assert all(entry is entries[0] for entry in entries)  # one object for every rank
    sink = BodySink(tmp_path)
    client = SGLangClient(sink.url, api_key="k", timeout_s=60)
    try:
        tracemalloc.start()
        client.update_weights_from_tensor(entries, version=None, flush_cache=False)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        # Control: the same request with a body made by json.dumps, as before, crosses the bound by far.
        tracemalloc.start()
        client.request("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": [entry.decode() for entry in entries], "weight_version": None,
            "flush_cache": False})
        _, control_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        sink.close()
    assert peak < payload_bytes / 4, (peak, payload_bytes)
    assert control_peak > 4 * payload_bytes, (control_peak, payload_bytes)
    sent, control = (json.loads(path.read_bytes()) for path in sink.bodies)
    assert sent == control == {"serialized_named_tensors": [entries[0].decode()] * 4, "weight_version": None,
                               "flush_cache": False}
    (name, tensor), = _unpickled(sent["serialized_named_tensors"][3])
    assert name == "big.weight" and torch.equal(tensor, bucket[0][1])


def test_the_streamed_body_is_the_json_of_the_request():
    body = tensor_update_body([b"QUJD", "REVG"], weight_version="7", flush_cache=True)
    joined = b"".join(body.pieces)
    assert len(joined) == body.length
    assert json.loads(joined) == {"serialized_named_tensors": ["QUJD", "REVG"], "weight_version": "7",
                                  "flush_cache": True}
    assert json.loads(b"".join(tensor_update_body(["QUJD"]).pieces)) == {"serialized_named_tensors": ["QUJD"]}
