"""Which server TP ranks get a handoff bucket as CUDA IPC handles (rollout/sglang/tensor_payloads.py): only a rank
on the bucket's own GPU; a handle opened on another GPU would create a CUDA context on the bucket's GPU."""

from dataclasses import dataclass

import torch

from dapo_megatron.rollout.sglang.tensor_payloads import BucketPayloads, bucket_gpu, entry_by_reference


@dataclass
class Server:
    tp_size: int
    same_host: bool
    gpus: range | None


def references(servers: list[Server], bucket_on: int | None) -> list[list[bool]]:
    return [[entry_by_reference(bucket_on, server, rank) for rank in range(server.tp_size)] for server in servers]


def test_one_node_of_four_tp2_servers_fed_from_gpu_0_sends_handles_to_gpu_0_only():
    # the 7B one-node example: servers on GPUs (0,1), (2,3), (4,5), (6,7); trainer rank 0 gathers on cuda:0
    servers = [Server(2, True, range(2 * i, 2 * i + 2)) for i in range(4)]
    assert references(servers, bucket_on=0) == [[True, False], [False, False], [False, False], [False, False]]
    assert references(servers, bucket_on=4) == [[False, False], [False, False], [True, False], [False, False]]


def test_no_handles_off_the_host_for_unknown_gpus_or_for_a_cpu_bucket():
    assert references([Server(2, False, range(0, 2))], bucket_on=0) == [[False, False]]
    assert references([Server(2, True, None)], bucket_on=0) == [[False, False]]  # attached: its GPUs unknown
    assert references([Server(2, True, range(0, 2))], bucket_on=None) == [[False, False]]


def test_a_cpu_bucket_goes_by_value_to_every_rank():
    bucket = [("w", torch.ones(3)), ("b", torch.zeros(2))]
    assert bucket_gpu(bucket) is None
    servers = [Server(2, True, range(0, 2)), Server(1, False, None)]
    payloads = BucketPayloads(bucket, servers)
    entries = payloads.for_server(servers[0]) + payloads.for_server(servers[1])
    assert not payloads.by_reference and len({id(entry) for entry in entries}) == 1  # one pickle, shared
