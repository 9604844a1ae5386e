"""The rollout batch's way from rank 0 to every rank (dapo_megatron.collectors.batch): packed into a fixed set of
flat tensors plus a small object, unpacked into exactly the batch rank 0 made, and received by the other ranks of a
real 2-rank gloo world while only rank 0 generates."""

from __future__ import annotations

import dataclasses
import datetime
import os
import random

import pytest
import torch
import torch.distributed as dist

from dapo_megatron.rank_zero import Rank0Error
from dapo_megatron.collectors.batch import hand_over_rollouts, pack_rollout_batch, unpack_rollout_batch
from dapo_megatron.collectors.group import RolloutGroup


def make_batch(seed: int, num_groups: int = 5) -> tuple[list[RolloutGroup], dict[str, float]]:
    """Groups of uneven sizes with empty responses, float32-exact and float64-only values, several finish reasons."""
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        size = rng.randint(1, 4)
        responses = [[rng.randrange(150_000) for _ in range(rng.randint(0, 7))] for _ in range(size)]
        penalties = [float(torch.tensor(-rng.random(), dtype=torch.float32)) for _ in range(size)]  # as .tolist() gives
        groups.append(RolloutGroup(
            prompt_ids=[rng.randrange(150_000) for _ in range(rng.randint(1, 6))],
            ground_truth=str(rng.randint(0, 99)), data_source=rng.choice(["math_dapo", "aime"]),
            responses=responses,
            engine_logprobs=[[float(torch.tensor(-rng.random() * 5, dtype=torch.float32)) for _ in r]
                             for r in responses],
            finish_reasons=[rng.choice(["stop", "length", "abort"]) for _ in responses],
            accs=[rng.random() < 0.5 for _ in responses],
            scores=[rng.choice([1.0, -1.0]) + p for p in penalties],
            overlong_penalties=penalties,
            weight_version=rng.randint(0, 3),
            # partial rollouts: per-token versions on some groups (e.g. [2, 2, 3]), none on others
            token_versions=[sorted(rng.randint(0, 3) for _ in r) for r in responses] if g % 2 else None))
    return groups, {"train/num_gen_batches": 2, "rollout/acc/mean": 0.3125}


def as_lists(batch):
    """An unpacked batch with its per-token tensors as lists, to compare with the lists rank 0 made."""
    groups, metrics = batch

    def listed(values):
        return values.tolist() if isinstance(values, torch.Tensor) else values

    return [dataclasses.replace(
        g, prompt_ids=listed(g.prompt_ids), responses=[listed(r) for r in g.responses],
        engine_logprobs=[listed(lp) for lp in g.engine_logprobs],
        token_versions=None if g.token_versions is None else [listed(v) for v in g.token_versions])
        for g in groups], metrics


def test_a_batch_survives_packing_exactly():
    groups, metrics = make_batch(0)
    groups[1].engine_logprobs[0][:1] = [-0.1]  # not a float32 value: that tensor must stay float64
    packed = pack_rollout_batch(groups, metrics)
    assert as_lists(unpack_rollout_batch(packed)) == (groups, metrics)
    assert packed.tensors["engine_logprobs"].dtype == torch.float64
    assert packed.tensors["response_ids"].dtype == torch.int32  # token ids fit 32 bits: half the bytes
    assert pack_rollout_batch(*make_batch(1)).tensors["engine_logprobs"].dtype == torch.float32


def test_the_bulk_travels_in_a_fixed_set_of_flat_tensors():
    small, large = pack_rollout_batch(*make_batch(2, 3)), pack_rollout_batch(*make_batch(3, 40))
    assert small.tensors.keys() == large.tensors.keys()  # not one object per response
    groups, _ = make_batch(3, 40)
    assert large.tensors["response_ids"].numel() == sum(len(r) for g in groups for r in g.responses)
    assert "responses" not in str(large.meta)  # only strings and metrics go pickled
    assert unpack_rollout_batch(pack_rollout_batch([], {})) == ([], {})


def test_unpacked_per_token_fields_are_views_of_what_crossed_not_lists():
    """Issue 26, item 6: ~80M tokens and log-probs as Python lists on every rank; now views into the flat tensors."""
    packed = pack_rollout_batch(*make_batch(8, 12))
    groups, _ = unpack_rollout_batch(packed)
    flat = {name: packed.tensors[name] for name in ("response_ids", "engine_logprobs", "token_versions")}
    versioned = [g for g in groups if g.token_versions is not None]
    assert versioned and all(isinstance(r, torch.Tensor) and r.dtype == torch.int64
                             for g in groups for r in g.responses)
    assert all(isinstance(lp, torch.Tensor) for g in groups for lp in g.engine_logprobs)
    storages = {t.untyped_storage().data_ptr() for g in groups for t in g.engine_logprobs}
    assert storages == {flat["engine_logprobs"].untyped_storage().data_ptr()}  # log-probs: no copy at all
    ids = {t.untyped_storage().data_ptr() for g in groups for t in g.responses}
    versions = {t.untyped_storage().data_ptr() for g in versioned for t in g.token_versions}
    assert len(ids) == 1 and len(versions) == 1  # one int64 tensor each, every response a view of it
    assert pack_rollout_batch(groups, {}).tensors["response_ids"].equal(packed.tensors["response_ids"])  # re-packs


def test_inconsistent_groups_and_unknown_fields_are_refused(monkeypatch):
    groups, metrics = make_batch(4)
    groups[2].scores.append(0.0)
    with pytest.raises(ValueError, match="group 2 has per-response lists of different lengths"):
        pack_rollout_batch(groups, metrics)
    groups, metrics = make_batch(4)
    groups[1].token_versions[0].append(0)
    with pytest.raises(ValueError, match="group 1's token_versions do not match"):
        pack_rollout_batch(groups, metrics)

    @dataclasses.dataclass
    class GroupWithMore(RolloutGroup):
        behaviour_logprobs: list | None = None

    from dapo_megatron.collectors import batch as rollout_batch

    monkeypatch.setattr(rollout_batch, "RolloutGroup", GroupWithMore)
    with pytest.raises(TypeError, match="behaviour_logprobs"):
        pack_rollout_batch(*make_batch(5))


# ------------------------------------------------------------------------------------------- two ranks

def _hand_over_twice() -> list:
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=60))
    generated = []

    def collect():
        generated.append(dist.get_rank())
        return make_batch(7, 12)

    def fail():
        raise ConnectionError("server went away")

    received = hand_over_rollouts(collect, what="step 1 rollouts")
    try:
        hand_over_rollouts(fail, what="step 2 rollouts")
        error = None
    except Rank0Error as exc:
        error = str(exc)
    return [received, generated, error]


def test_the_other_rank_receives_exactly_rank_0s_batch():
    from spawn_ranks import run_distributed

    (batch_0, generated_0, error_0), (batch_1, generated_1, error_1) = run_distributed(_hand_over_twice, 2,
                                                                                       timeout_s=120)
    expected = make_batch(7, 12)
    assert as_lists(batch_0) == expected and as_lists(batch_1) == expected
    assert (generated_0, generated_1) == ([0], [])  # only rank 0 generated
    assert error_0 == error_1 == "step 2 rollouts failed on rank 0: ConnectionError: server went away"
