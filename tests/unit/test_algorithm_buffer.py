"""Dynamic sampling: keep groups with 0 < #correct < G, exact batch size, surplus policy, checkpoint state."""

import io
from dataclasses import dataclass, field

import pytest
import torch

from dapo_megatron.algorithm import DynamicSamplingBuffer, FilterStats

torch.set_num_threads(1)


@dataclass
class Group:
    """A trainer-style group: per-response correctness, shaped scores, tensors and text."""

    prompt_id: int
    accs: list[bool]
    scores: list[float] = field(default_factory=list)
    token_ids: torch.Tensor = field(default_factory=lambda: torch.arange(4))
    prompt: str = "What is 2+2?"


MIXED = [True, False, False, True]
ALL_RIGHT = [True] * 4
ALL_WRONG = [False] * 4


def _groups(pattern, start=0):
    return [Group(prompt_id=start + index, accs=list(accs)) for index, accs in enumerate(pattern)]


def test_filters_all_correct_and_all_wrong():
    buffer = DynamicSamplingBuffer(target_groups=4)
    stats = buffer.add(_groups([MIXED, ALL_RIGHT, ALL_WRONG, MIXED, ALL_WRONG]))
    assert stats == FilterStats(num_groups=5, num_kept=2, num_all_correct=1, num_all_wrong=2)
    assert stats.kept_fraction == pytest.approx(0.4)
    assert stats.all_correct_fraction == pytest.approx(0.2)
    assert stats.all_wrong_fraction == pytest.approx(0.4)
    assert len(buffer) == 2 and not buffer.is_full and buffer.num_missing == 2


def test_keep_decision_uses_acc_not_shaped_score():
    """All correct but penalized for length: scores differ, yet the group carries no signal and is dropped."""
    buffer = DynamicSamplingBuffer(target_groups=1)
    stats = buffer.add([Group(prompt_id=0, accs=ALL_RIGHT, scores=[1.0, 0.5, 1.0, 0.2])])
    assert stats.num_kept == 0 and stats.num_all_correct == 1


def test_accs_may_be_a_tensor_or_a_dict_key():
    buffer = DynamicSamplingBuffer(target_groups=3)
    stats = buffer.add(
        [
            Group(prompt_id=0, accs=torch.tensor([True, False])),
            {"accs": [False, True], "prompt_id": 1},
            {"accs": torch.tensor([True, True])},
        ]
    )
    assert stats.num_kept == 2 and stats.num_all_correct == 1


def test_pop_returns_exactly_target_groups_and_keeps_surplus():
    buffer = DynamicSamplingBuffer(target_groups=3, surplus_policy="keep")
    with pytest.raises(RuntimeError, match="holds 0 of 3"):
        buffer.pop()
    buffer.add(_groups([MIXED, ALL_WRONG, MIXED]))
    buffer.add(_groups([MIXED, MIXED, MIXED], start=10))
    assert buffer.is_full and len(buffer) == 5
    batch = buffer.pop()
    assert [group.prompt_id for group in batch] == [0, 2, 10]  # arrival order
    assert [group.prompt_id for group in buffer.state_dict()["groups"]] == [11, 12]
    buffer.add(_groups([MIXED], start=20))
    assert [group.prompt_id for group in buffer.pop()] == [11, 12, 20]
    assert len(buffer) == 0


def test_drop_policy_discards_surplus():
    buffer = DynamicSamplingBuffer(target_groups=2, surplus_policy="drop")
    buffer.add(_groups([MIXED] * 5))
    assert len(buffer.pop()) == 2
    assert len(buffer) == 0


def test_drain_returns_what_there_is_at_the_round_cap():
    buffer = DynamicSamplingBuffer(target_groups=4)
    buffer.add(_groups([MIXED, ALL_RIGHT, MIXED]))
    partial = buffer.drain()
    assert [group.prompt_id for group in partial] == [0, 2]
    assert len(buffer) == 0 and buffer.drain() == []


def test_filtering_disabled_keeps_every_group_and_still_counts():
    buffer = DynamicSamplingBuffer(target_groups=3, filter_groups=False)
    stats = buffer.add(_groups([ALL_RIGHT, ALL_WRONG, MIXED]))
    assert stats == FilterStats(num_groups=3, num_kept=3, num_all_correct=1, num_all_wrong=1)
    assert [group.prompt_id for group in buffer.pop()] == [0, 1, 2]


def test_stats_accumulate_over_rounds():
    buffer = DynamicSamplingBuffer(target_groups=10)
    total = FilterStats()
    total += buffer.add(_groups([MIXED, ALL_RIGHT]))
    total += buffer.add(_groups([ALL_WRONG, MIXED, MIXED]))
    assert total == FilterStats(num_groups=5, num_kept=3, num_all_correct=1, num_all_wrong=1)
    assert FilterStats().kept_fraction == 0.0


def test_state_round_trip_through_torch_save():
    buffer = DynamicSamplingBuffer(target_groups=2)
    groups = [
        Group(prompt_id=7, accs=MIXED, scores=[1.0, -1.0, -1.0, 0.5], token_ids=torch.tensor([5, 6, 7]), prompt="é?"),
        Group(prompt_id=8, accs=[False, True], token_ids=torch.zeros(2, 3)),
    ]
    buffer.add(groups)
    stream = io.BytesIO()
    torch.save(buffer.state_dict(), stream)
    stream.seek(0)

    restored = DynamicSamplingBuffer(target_groups=2)
    restored.load_state_dict(torch.load(stream, weights_only=False))
    popped = restored.pop()
    assert [group.prompt_id for group in popped] == [7, 8]
    assert popped[0].prompt == "é?" and popped[0].scores == [1.0, -1.0, -1.0, 0.5]
    assert torch.equal(popped[0].token_ids, torch.tensor([5, 6, 7]))
    assert torch.equal(popped[1].token_ids, torch.zeros(2, 3))


def test_dict_groups_round_trip_with_weights_only_load():
    buffer = DynamicSamplingBuffer(target_groups=5)
    buffer.add([{"accs": [True, False], "ids": torch.tensor([1, 2]), "text": "x", "n": 3}])
    stream = io.BytesIO()
    torch.save(buffer.state_dict(), stream)
    stream.seek(0)
    restored = DynamicSamplingBuffer(target_groups=5)
    restored.load_state_dict(torch.load(stream, weights_only=True))
    (group,) = restored.drain()
    assert group["text"] == "x" and group["n"] == 3 and torch.equal(group["ids"], torch.tensor([1, 2]))


def test_state_dict_is_a_snapshot():
    buffer = DynamicSamplingBuffer(target_groups=1)
    buffer.add(_groups([MIXED, MIXED]))
    state = buffer.state_dict()
    buffer.pop()
    assert len(state["groups"]) == 2


def test_bad_groups_and_config_are_named():
    buffer = DynamicSamplingBuffer(target_groups=2)
    with pytest.raises(TypeError, match=r"\.accs"):
        buffer.add([object()])
    with pytest.raises(ValueError, match="group 1 has no responses"):
        buffer.add([Group(prompt_id=0, accs=MIXED), Group(prompt_id=1, accs=[])])
    with pytest.raises(TypeError, match=r"\.accs"):
        buffer.load_state_dict({"groups": [42]})
    with pytest.raises(ValueError, match="surplus_policy"):
        DynamicSamplingBuffer(target_groups=2, surplus_policy="recycle")
    with pytest.raises(ValueError, match="target_groups"):
        DynamicSamplingBuffer(target_groups=0)
