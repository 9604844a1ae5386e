"""The weight handoff of a Qwen3-MoE policy whose experts are split over expert-parallel ranks (4 gloo ranks).

* TP2 × EP2: :func:`export_hf_buckets` yields, on the source only, the HF state dict the weights came from,
  bit-exact, every name once, in the order :func:`stage_export_mappings` announces, each bucket within
  ``bucket_bytes`` unless it is one larger tensor. The experts come from their EP ranks: every gather hands the source
  one parameter of one local slot from each EP rank (never more than EP × TP shards of one expert parameter).
* TP1 × PP2 × EP2: :func:`gather_hf_buckets_to_rank0` brings every stage's experts to global rank 0, bf16.
* TP2 × EP2 with ``every_rank``: every rank makes the same buckets (each GPU's own copy, handoff/gpu_copies.py).
"""

from __future__ import annotations

import pytest
import torch
from spawn_ranks import run_distributed
from tiny_models import save_random_hf_model
from tiny_qwen3 import EVEN_EXPERTS, tiny_qwen3_moe_config

BUCKET_BYTES = 8 * 1024  # between the tiny model's tensor sizes (norms 48 B ... embedding 19 KB)


class RecordingGather:
    """The backend's own TP gather, recording (group size, bytes of every rank's shards) of each gathered
    parameter on the rank that receives them."""

    def __init__(self, inner) -> None:
        self.inner, self.gathered = inner, []

    def open(self, group, shards):
        import torch.distributed as dist

        shard_gather, record, size = self.inner.open(group, shards), self.gathered, dist.get_world_size(group)

        class Recorded:
            def shards(self, index, own):
                got = shard_gather.shards(index, own)
                if got is not None:
                    record.append((size, sum(t.numel() * t.element_size() for t in got)))
                return got

            def finish(self):
                shard_gather.finish()

        return Recorded()


def _job(model_dir: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dapo_megatron.handoff import export_hf_buckets, gather_hf_buckets_to_rank0
    from dapo_megatron.handoff.exporter import stage_export_mappings
    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec
    from dapo_megatron.policy.model import build_model, transformer_config

    out = {}
    for name, (tp, pp, ep) in {"tp2_ep2": (2, 1, 2), "pp2_ep2": (1, 2, 2)}.items():
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        backend = init_distributed(tp, pp, expert_parallel=ep).backend
        seed_everything(0)
        spec = load_model_spec(model_dir)
        model = build_model(spec, transformer_config(spec, backend, tensor_parallel=tp, pipeline_parallel=pp,
                                                     expert_parallel=ep), backend)
        load_hf_weights(model, spec, model_dir)
        if name == "tp2_ep2":
            gather = RecordingGather(backend.tp_gather)
            buckets = [[(n, t.clone()) for n, t in bucket]
                       for bucket in export_hf_buckets(model, spec, bucket_bytes=BUCKET_BYTES, tp_gather=gather)]
            announced = [n for m in stage_export_mappings(model, spec) for n in m.hf_names]
            everywhere = [[(n, t.clone()) for n, t in bucket]
                          for bucket in export_hf_buckets(model, spec, bucket_bytes=BUCKET_BYTES, every_rank=True)]
            out[name] = dict(rank=dist.get_rank(), buckets=buckets, announced=announced, gathered=gather.gathered,
                             everywhere=everywhere)
        else:
            received = [[(n, t.clone()) for n, t in bucket] for bucket in gather_hf_buckets_to_rank0(
                model, spec, bucket_bytes=BUCKET_BYTES, dtype=torch.bfloat16, tp_gather=backend.tp_gather)]
            out[name] = dict(rank=dist.get_rank(), buckets=received)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from safetensors.torch import load_file

    model_dir = tmp_path_factory.mktemp("moe") / "qwen3_moe"
    save_random_hf_model(model_dir, tiny_qwen3_moe_config(num_experts=EVEN_EXPERTS, topk=2), seed=7)
    return load_file(str(model_dir / "model.safetensors")), run_distributed(_job, 4, str(model_dir), timeout_s=600)


def _assert_is_the_state_dict(buckets, reference, dtype=None):
    names = [n for bucket in buckets for n, _ in bucket]
    assert len(names) == len(set(names)) and set(names) == set(reference)
    for bucket in buckets:
        for name, tensor in bucket:
            expected = reference[name] if dtype is None else reference[name].to(dtype)
            assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name


@pytest.mark.slow  # 4 processes
def test_experts_stream_from_their_ep_ranks_to_the_source_bit_exact(exported):
    reference, ranks = exported
    source, *others = [r["tp2_ep2"] for r in ranks]
    assert source["rank"] == 0 and all(not other["buckets"] for other in others)
    _assert_is_the_state_dict(source["buckets"], reference)
    assert [n for bucket in source["buckets"] for n, _ in bucket] == source["announced"]
    assert all(sum(t.numel() * t.element_size() for _, t in bucket) <= BUCKET_BYTES or len(bucket) == 1
               for bucket in source["buckets"])
    # The experts' gathers (over the 4 ranks of TP x EP): each brings one parameter of one local slot from each EP
    # rank — 2 experts' fc1 (gate + up) or fc2 — 4 layers x 3 slots x 2 parameters of them.
    def expert_bytes(*projections):
        return sum(reference[f"model.layers.0.mlp.experts.0.{p}_proj.weight"].numel() * 4 for p in projections)

    expert_gathers = [nbytes for group_size, nbytes in source["gathered"] if group_size == 4]
    assert len(expert_gathers) == 4 * 3 * 2
    assert set(expert_gathers) == {2 * expert_bytes("gate", "up"), 2 * expert_bytes("down")}


@pytest.mark.slow  # 4 processes
def test_every_rank_can_make_the_whole_state_dict_itself(exported):
    """The export on every rank (each GPU's own copy for its colocated server rank, handoff/gpu_copies.py): at TP2 x
    EP2 (DP 2) every rank — TP peers, the other DP replica, both EP ranks — makes the same buckets as the source."""
    reference, ranks = exported
    source = ranks[0]["tp2_ep2"]
    for rank in ranks:
        everywhere = rank["tp2_ep2"]["everywhere"]
        _assert_is_the_state_dict(everywhere, reference)
        assert [[n for n, _ in b] for b in everywhere] == [[n for n, _ in b] for b in source["buckets"]]


@pytest.mark.slow  # 4 processes
def test_every_stage_and_expert_reaches_rank0_in_bf16(exported):
    reference, ranks = exported
    rank0, *others = [r["pp2_ep2"] for r in ranks]
    assert all(not other["buckets"] for other in others)
    _assert_is_the_state_dict(rank0["buckets"], reference, dtype=torch.bfloat16)
