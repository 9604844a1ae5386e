"""Where routing replay keeps what it recorded (dapo_megatron/policy/moe_routing.py): host memory, int16."""

import torch

from dapo_megatron.policy.moe_routing import host_copy, recorded_routing_bytes


def test_recorded_indices_are_kept_as_int16_in_host_memory():
    recorded = torch.tensor([[3, 127], [0, 5]], dtype=torch.long)
    kept = host_copy(recorded)
    assert kept.device.type == "cpu" and kept.dtype == torch.int16 and torch.equal(kept.long(), recorded)
    assert not kept.is_pinned()  # pinning is for copies from the GPU; a CPU run has nothing to overlap


def test_recorded_routing_is_768_bytes_a_token_for_qwen3_30b():
    assert recorded_routing_bytes(tokens=1, layers=48, topk=8) == 768  # the figure
    assert recorded_routing_bytes(tokens=20_000, layers=48, topk=8) == 15_360_000
