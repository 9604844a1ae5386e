"""PromptSampler: seeded order, per-epoch reshuffle, exact resume mid-epoch and across an epoch boundary."""

import json
import random

import pytest

from dapo_megatron.data.sampler import PromptSampler

ITEMS = [f"prompt-{i}" for i in range(10)]


def _take(sampler, n, size=None):
    return [sampler.next_batch(size) for _ in range(n)]


def test_same_seed_same_batches_other_seed_differs():
    assert _take(PromptSampler(ITEMS, batch_size=3, seed=7), 8) == _take(PromptSampler(ITEMS, batch_size=3, seed=7), 8)
    assert _take(PromptSampler(ITEMS, batch_size=3, seed=7), 8) != _take(PromptSampler(ITEMS, batch_size=3, seed=8), 8)


def test_epoch_order_is_the_seed_plus_epoch_shuffle():
    sampler = PromptSampler(ITEMS, batch_size=5, seed=3)
    for epoch in range(3):
        order = list(range(10))
        random.Random(3 + epoch).shuffle(order)
        assert sampler.next_indices() + sampler.next_indices() == order
        assert sampler.epoch == epoch
    epoch0, epoch1 = list(range(10)), list(range(10))
    random.Random(3).shuffle(epoch0)
    random.Random(4).shuffle(epoch1)
    assert epoch0 != epoch1


def test_leftover_is_dropped_and_batches_never_repeat_an_item():
    sampler = PromptSampler(ITEMS, batch_size=4, seed=0)
    batches = [sampler.next_indices() for _ in range(6)]  # 2 per epoch, 2 items dropped per epoch
    for batch in batches:
        assert len(set(batch)) == 4
    assert sampler.epoch == 2
    assert len(set(batches[0] + batches[1])) == 8


@pytest.mark.parametrize("taken_before_save", [3, 4, 6])
def test_exact_resume(taken_before_save):
    # batch 3 of 10 items: 3 batches per epoch, so 3 saves exactly at the boundary (epoch 0, cursor 9),
    # 4 saves mid-epoch 1, 6 saves at the end of epoch 1
    original = PromptSampler(ITEMS, batch_size=3, seed=11)
    _take(original, taken_before_save)
    saved = json.loads(json.dumps(original.state_dict()))
    expected = _take(original, 7)

    resumed = PromptSampler(ITEMS, batch_size=3, seed=11)
    resumed.load_state_dict(saved)
    assert _take(resumed, 7) == expected


def test_resume_with_variable_batch_sizes():
    sizes = [4, 2, 5, 3, 6, 1, 4, 4]
    original = PromptSampler(ITEMS, batch_size=4, seed=2)
    for size in sizes[:3]:
        original.next_batch(size)
    saved = original.state_dict()
    expected = [original.next_batch(size) for size in sizes[3:]]
    resumed = PromptSampler(ITEMS, batch_size=4, seed=2)
    resumed.load_state_dict(saved)
    assert [resumed.next_batch(size) for size in sizes[3:]] == expected


def test_iteration_is_endless_batches():
    sampler = PromptSampler(ITEMS, batch_size=5, seed=0)
    batches = [batch for batch, _ in zip(sampler, range(5))]
    assert len(batches) == 5 and sampler.epoch == 2


def test_state_for_other_data_or_seed_is_rejected():
    state = PromptSampler(ITEMS, batch_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_items=10 but this sampler has num_items=9"):
        PromptSampler(ITEMS[:9], batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1 but this sampler has seed=2"):
        PromptSampler(ITEMS, batch_size=2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="impossible position"):
        PromptSampler(ITEMS, batch_size=2, seed=1).load_state_dict({**state, "cursor": 11})


def test_bad_sizes():
    with pytest.raises(ValueError, match="batch_size must be in"):
        PromptSampler(ITEMS, batch_size=11, seed=0)
    with pytest.raises(ValueError, match="at least one item"):
        PromptSampler([], batch_size=1, seed=0)
    with pytest.raises(ValueError, match="batch size must be in"):
        PromptSampler(ITEMS, batch_size=2, seed=0).next_batch(0)
