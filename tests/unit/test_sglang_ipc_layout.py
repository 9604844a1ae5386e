"""Which server TP ranks get a handoff bucket as CUDA IPC handles (rollout/sglang/tensor_payloads.py): only a rank
on a GPU that holds the bucket — the bucket's own, or one whose trainer rank made a copy of its own
(handoff/gpu_copies.py); a handle opened on another GPU would create a CUDA context on that GPU."""

from dataclasses import dataclass

import torch

from dapo_megatron.hf_format import BucketWithCopies
from dapo_megatron.rollout.sglang.tensor_payloads import BucketPayloads, bucket_gpu, by_value_entries, entry_gpu


@dataclass
class Server:
    tp_size: int
    same_host: bool
    gpus: range | None


def sources(servers: list[Server], bucket_on: int | None, copies=()) -> list[list[int | None]]:
    return [[entry_gpu(bucket_on, copies, server, rank) for rank in range(server.tp_size)] for server in servers]


ONE_NODE = [Server(2, True, range(2 * i, 2 * i + 2)) for i in range(4)]  # the 7B one-node examples: 4 servers x TP 2


def test_every_server_rank_gets_the_copy_on_its_own_gpu_when_every_gpu_hosts_a_trainer_rank():
    """Issue 40.5: fed from GPU 0 alone, seven of the eight server ranks got every bucket by value (~142 GB of base64
    a step for the 7B examples); with each trainer rank's copy, none does."""
    assert by_value_entries(ONE_NODE, bucket_on=0, copies=()) == 7  # the bucket on rank 0's GPU only
    assert by_value_entries(ONE_NODE, bucket_on=0, copies=range(1, 8)) == 0
    assert sources(ONE_NODE, 0, range(1, 8)) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # each its own GPU's copy
    assert by_value_entries(ONE_NODE, bucket_on=0, copies=range(1, 6)) == 2  # GPUs 6 and 7 without a trainer rank


def test_one_node_of_four_tp2_servers_fed_from_gpu_0_sends_handles_to_gpu_0_only():
    assert sources(ONE_NODE, 0) == [[0, None], [None, None], [None, None], [None, None]]
    assert sources(ONE_NODE, 4) == [[None, None], [None, None], [4, None], [None, None]]


def test_no_handles_off_the_host_for_unknown_gpus_or_for_a_cpu_bucket():
    assert sources([Server(2, False, range(0, 2))], 0, copies=[1]) == [[None, None]]
    assert sources([Server(2, True, None)], 0, copies=[1]) == [[None, None]]  # attached: its GPUs unknown
    assert sources([Server(2, True, range(0, 2))], None) == [[None, None]]


def test_a_cpu_bucket_goes_by_value_to_every_rank():
    bucket = [("w", torch.ones(3)), ("b", torch.zeros(2))]
    assert bucket_gpu(bucket) is None
    servers = [Server(2, True, range(0, 2)), Server(1, False, None)]
    payloads = BucketPayloads(bucket, servers)
    entries = payloads.for_server(servers[0]) + payloads.for_server(servers[1])
    assert not payloads.by_reference and len({id(entry) for entry in entries}) == 1  # one pickle, shared


def test_the_payload_hands_each_server_rank_the_serialized_copy_of_its_gpu(monkeypatch):
    from dapo_megatron.rollout.sglang import tensor_payloads

    monkeypatch.setattr(tensor_payloads, "bucket_gpu", lambda tensors: 0)  # rank 0's bucket on GPU 0
    monkeypatch.setattr(tensor_payloads, "serialize_by_reference", lambda tensors: b"handles of GPU 0")
    bucket = BucketWithCopies([("w", torch.ones(3))], {gpu: f"handles of GPU {gpu}".encode() for gpu in range(1, 8)})
    payloads = BucketPayloads(bucket, ONE_NODE)
    assert [payloads.for_server(server) for server in ONE_NODE] == [
        [f"handles of GPU {gpu}".encode() for gpu in server.gpus] for server in ONE_NODE]
    assert payloads.by_reference  # rank 0's own handles: its window keeps the bucket
