"""Several training sources (data.train): drawn in proportion to their weights, resumed exactly, each named for
per-source metrics; folders (save_to_disk, parquet / jsonl shards) read at start or as drawn."""

from __future__ import annotations

import json
import random

import datasets
import pytest

from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.data.dapo_math import load_dapo_math, write_jsonl, write_parquet
from dapo_megatron.data.fixtures import AIME_FIXTURE, DAPO_MATH_FIXTURE
from dapo_megatron.data.folders import StreamedPrompts, folder_dataset
from dapo_megatron.data.mixture import MixtureSampler, MixtureSource
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.data.tokenizer import build_tiny_tokenizer
from dapo_megatron.data.task import check_training_data, train_sampler
from dapo_megatron.user_errors import DataError

MINIMAL = ["model.source=tiny", "data.source=dapo_math", "data.max_prompt_length=4096"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


def _rows(path=DAPO_MATH_FIXTURE) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _sources(*sizes_and_weights) -> list[MixtureSource]:
    return [MixtureSource(f"s{i}", weight, [f"s{i}-{j}" for j in range(size)])
            for i, (size, weight) in enumerate(sizes_and_weights)]


# ------------------------------------------------------------------------------------------------ proportions

@pytest.mark.parametrize("weights", [(0.7, 0.3), (1, 1), (5, 2, 1), (0.05, 0.9, 0.05)])
def test_every_prefix_of_the_draws_is_within_one_prompt_of_each_share(weights):
    sampler = MixtureSampler(_sources(*[(7 + 3 * i, w) for i, w in enumerate(weights)]), seed=3)
    shares = [w / sum(weights) for w in weights]

    def within_one(draws) -> bool:
        counts = [0] * len(weights)
        for n, source in enumerate(draws, start=1):
            counts[source] += 1
            if any(abs(c - s * n) >= 1 for c, s in zip(counts, shares)):
                return False
        return True

    assert within_one(int(prompt.split("-")[0][1:]) for prompt in sampler.next_batch(2000))
    # the control: drawing each prompt's source at random with the same weights leaves the bound within 2000 draws
    rng = random.Random(0)
    assert not within_one(rng.choices(range(len(weights)), weights=weights, k=2000))


def test_a_small_source_cycles_through_epochs_while_a_large_one_does_not():
    sampler = MixtureSampler(_sources((5, 1), (1000, 1)), seed=0)
    drawn = sampler.next_batch(40)
    small = [p for p in drawn if p.startswith("s0-")]
    assert len(small) == 20 and sorted(small[:5]) == [f"s0-{j}" for j in range(5)]  # each epoch visits all
    assert small[:5] != small[5:10]  # reshuffled per epoch
    large = [p for p in drawn if p.startswith("s1-")]
    assert len(set(large)) == 20  # no repeats within an epoch


def test_the_position_resumes_exactly():
    original = MixtureSampler(_sources((5, 0.3), (11, 0.7)), seed=9)
    original.next_batch(37)
    state = json.loads(json.dumps(original.state_dict()))  # it is plain data
    expected = original.next_batch(50)
    resumed = MixtureSampler(_sources((5, 0.3), (11, 0.7)), seed=9)
    assert resumed.next_batch(50) != expected  # the control: a fresh sampler draws other prompts
    resumed = MixtureSampler(_sources((5, 0.3), (11, 0.7)), seed=9)
    resumed.load_state_dict(state)
    assert resumed.next_batch(50) == expected
    for other, message in ((_sources((5, 0.3), (12, 0.7)), "num_items"),
                           ([MixtureSource("x", 1, ["a"])], "sources are")):
        with pytest.raises(ValueError, match=message):
            MixtureSampler(other, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="single pool"):
        plain_state = PromptSampler(["a"], batch_size=1, seed=9).state_dict()
        MixtureSampler(_sources((5, 1)), seed=9).load_state_dict(plain_state)


def test_skipped_rows_are_replaced_from_the_same_source():
    sources = [MixtureSource("a", 1, ["a0", None, "a2", None]), MixtureSource("b", 1, ["b0", "b1"])]
    sampler = MixtureSampler(sources, seed=1)
    drawn = sampler.next_batch(20)
    assert None not in drawn and sum(p.startswith("a") for p in drawn) == 10
    assert sampler.skipped[0] > 0 and sampler.skipped[1] == 0
    with pytest.raises(DataError, match="'dead'.*all skipped"):
        MixtureSampler([MixtureSource("dead", 1, [None, None])], seed=0).next_batch(1)


# ------------------------------------------------------------------------------------------------ folders

def _shards(tmp_path, kind: str):
    rows = _rows()
    folder = tmp_path / f"{kind}_shards"
    writer = write_parquet if kind == "parquet" else write_jsonl
    for i in range(3):
        writer(rows[i::3], folder / f"part-{i:03d}.{kind}")
    return folder


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "save_to_disk"])
def test_a_folder_reads_like_the_file_its_rows_came_from(tmp_path, kind):
    if kind == "save_to_disk":
        folder = tmp_path / "saved"
        datasets.Dataset.from_list(_rows()).save_to_disk(str(folder))
    else:
        folder = _shards(tmp_path, kind)
    from_folder, from_file = load_dapo_math(folder), load_dapo_math(DAPO_MATH_FIXTURE)
    assert from_folder.report.total_rows == 37 and len(from_folder) == len(from_file) == 30
    # the same problems and answers (which copy of a repeated prompt comes first depends on the shard order)
    assert {(r.prompt_key, r.ground_truth) for r in from_folder.rows} == {(r.prompt_key, r.ground_truth)
                                                                          for r in from_file.rows}


def test_a_streamed_folder_makes_the_same_prompts_when_drawn(tmp_path, tokenizer):
    from dapo_megatron.data.prompts import build_prompt_records
    from dapo_megatron.data.schema import validate_row

    folder = _shards(tmp_path, "parquet")
    dataset = folder_dataset(folder)
    streamed = StreamedPrompts(folder, dataset, tokenizer, max_prompt_length=4096, integer_answers=True,
                               on_bad_row="error", source_name="big")
    assert len(streamed) == 37  # every row: a streamed folder is not deduplicated
    rows = [validate_row(dataset[i], source="x", row=i, integer_answers=True) for i in range(37)]
    eager = build_prompt_records(rows, tokenizer, max_prompt_length=4096, source_name="big").records
    assert [streamed[i] for i in range(37)] == list(eager)
    short = StreamedPrompts(folder, dataset, tokenizer, max_prompt_length=8, integer_answers=True,
                            on_bad_row="error")
    assert short[0] is None  # too long: skipped when drawn


def test_bad_folders_are_data_errors(tmp_path):
    mixed = _shards(tmp_path, "parquet")
    write_jsonl(_rows()[:2], mixed / "extra.jsonl")
    with pytest.raises(DataError, match="both parquet and jsonl"):
        folder_dataset(mixed)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no \\*.parquet"):
        folder_dataset(tmp_path / "empty")
    wrong = tmp_path / "wrong"
    write_jsonl([{"question": "1+1", "answer": "2"}], wrong / "a.jsonl")
    with pytest.raises(DataError, match="no column data_source, prompt, reward_model"):
        folder_dataset(wrong)


# ------------------------------------------------------------------------------------------------ from the config

def test_a_two_source_config_draws_by_weight_with_names(tmp_path, tokenizer):
    sources = (f"data.train=[{{path: {DAPO_MATH_FIXTURE}, weight: 3}}, {{path: {tmp_path / 'saved'}, weight: 1, "
               "name: aime-big}]")
    config = load_config(None, [*MINIMAL, sources, "data.stream_above_rows=3"])
    datasets.Dataset.from_list(_rows(AIME_FIXTURE)).save_to_disk(str(tmp_path / "saved"))
    check_training_data(config)
    sampler = train_sampler(config, tokenizer)
    assert isinstance(sampler, MixtureSampler) and [s.name for s in sampler.sources] == ["math_dapo", "aime-big"]
    assert isinstance(sampler.sources[1].prompts, StreamedPrompts)  # 6 rows > stream_above_rows
    drawn = sampler.next_batch(40)
    assert [r.source_name for r in drawn].count("math_dapo") == 30
    assert {r.data_source for r in drawn} == {"math_dapo", "aime-2024"}  # what a reward function dispatches on


def test_sources_must_have_different_names_and_the_old_keys_still_work(tmp_path, tokenizer):
    copy = tmp_path / "copy.jsonl"
    write_jsonl(_rows()[:5], copy)
    same = load_config(None, MINIMAL + [f"data.train=[{{path: {DAPO_MATH_FIXTURE}}}, {{path: {copy}}}]"])
    with pytest.raises(ConfigError, match=r"data.train\[1\].name: 'math_dapo' is also data.train\[0\]'s"):
        check_training_data(same)
    named = load_config(None, MINIMAL + [f"data.train=[{{path: {DAPO_MATH_FIXTURE}}}, {{path: {copy}, name: b}}]"])
    check_training_data(named)
    legacy = train_sampler(load_config(None, MINIMAL + [f"data.train_files=[{DAPO_MATH_FIXTURE}]",
                                                        "trainer.train_batch_size=4",
                                                        "trainer.mini_batch_size=2",
                                                        "algorithm.gen_batch_size=4"]), tokenizer)
    assert isinstance(legacy, PromptSampler) and len(legacy.items) == 30
    with pytest.raises(ConfigError, match="two ways"):
        load_config(None, MINIMAL + [f"data.train_files=[{copy}]", f"data.train=[{{path: {copy}}}]"])
    with pytest.raises(ConfigError, match=r"data.train\[0\].weight: must be > 0"):
        load_config(None, MINIMAL + [f"data.train=[{{path: {copy}, weight: 0}}]"])


def test_largest_deficit_matches_a_long_random_mixture():
    """Against random weights: after n draws each source holds floor or ceil of its share."""
    rng = random.Random(0)
    for _ in range(20):
        weights = [rng.uniform(0.1, 5) for _ in range(rng.randint(2, 5))]
        sampler = MixtureSampler(_sources(*[(3, w) for w in weights]), seed=rng.randint(0, 99))
        sampler.next_batch(997)
        shares = [w / sum(weights) * 997 for w in weights]
        assert all(abs(g - s) < 1 for g, s in zip(sampler.given, shares)), (sampler.given, shares)
