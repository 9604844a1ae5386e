"""The scratchpad task (data.synthetic.mode: scratchpad): lengths that spread, correct references, determinism,
held-out disjointness, config errors, and the default task left byte-identical."""

import collections
import hashlib
import json
import statistics

import pytest

from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.data.synthetic import make_split
from dapo_megatron.data.synthetic_scratchpad import ScratchpadTaskConfig, make_scratchpad_split
from dapo_megatron.data.task import synthetic_split
from dapo_megatron.reward.rule import math_reward
from test_data_synthetic import evaluate

SYNTHETIC = ["model.source=tiny", "data.source=synthetic", "data.synthetic.num_train=600",
             "data.synthetic.num_heldout=200"]
SCRATCHPAD = [*SYNTHETIC, "data.synthetic.mode=scratchpad"]


@pytest.fixture(scope="module")
def split():
    return make_scratchpad_split(seed=5, n_train=2000, n_heldout=300, config=ScratchpadTaskConfig(2, 10))


def _terms(problem) -> int:
    return problem.expression.count("+") + problem.expression.count("-") + 1


def test_every_term_count_appears_and_solutions_grow_with_it(split):
    counts = collections.Counter(_terms(p) for p in split.train)
    assert sorted(counts) == list(range(2, 11))
    assert min(counts.values()) > 0.5 * len(split.train) / 9  # roughly uniform, no count starved
    for problem in split.train:
        assert len(problem.solution.splitlines()) == _terms(problem)  # one line per operation + the answer line


def test_solution_lengths_spread_widely(split):
    lengths = sorted(len(p.solution) for p in split.train)
    deciles = statistics.quantiles(lengths, n=10)
    assert deciles[-1] >= 3 * deciles[0], deciles  # the longest tenth needs 3x the characters of the shortest
    assert statistics.pstdev(lengths) > 0.35 * statistics.fmean(lengths)
    # Control: the default task's solutions (3-4 term chains, products) are nearly all the same length.
    default = sorted(len(p.solution) for p in make_split(seed=5, n_train=2000, n_heldout=0).train)
    default_deciles = statistics.quantiles(default, n=10)
    assert default_deciles[-1] < 2 * default_deciles[0]
    assert statistics.pstdev(default) < 0.25 * statistics.fmean(default)


def test_the_rule_reward_accepts_every_reference_solution(split):
    for problem in split.train + split.heldout:
        assert problem.answer == evaluate(problem.expression) >= 0
        row = problem.to_row(0, "train")
        assert math_reward(problem.solution, row["reward_model"]["ground_truth"]).score == 1.0, problem
    # Control: a solution one off is graded wrong.
    wrong = split.train[0].solution.rsplit(" ", 1)[0] + f" {split.train[0].answer + 1}"
    assert math_reward(wrong, str(split.train[0].answer)).score == -1.0


def test_working_lines_follow_the_chain_and_never_go_negative(split):
    for problem in split.train[:300]:
        *lines, answer_line = problem.solution.splitlines()
        value = None
        for line in lines:
            left, result = line.split("=")
            assert value is None or left.startswith(str(value))
            assert evaluate(left) == int(result) >= 0
            value = int(result)
        assert answer_line == f"Answer: {problem.answer}" and value == problem.answer


def test_same_seed_same_problems_other_seed_differs(split):
    config = ScratchpadTaskConfig(2, 10)
    assert make_scratchpad_split(seed=5, n_train=2000, n_heldout=300, config=config) == split
    assert make_scratchpad_split(seed=6, n_train=2000, n_heldout=300, config=config) != split


def test_heldout_is_distinct_and_never_trained_on(split):
    heldout = {p.expression for p in split.heldout}
    assert len(heldout) == len(split.heldout) == 300
    assert not heldout & {p.expression for p in split.train}


def test_config_selects_the_task_and_its_range():
    split = synthetic_split(load_config(None, [*SCRATCHPAD, "data.synthetic.scratchpad.min_terms=4",
                                               "data.synthetic.scratchpad.max_terms=6"]))
    assert {_terms(p) for p in split.train} == {4, 5, 6}
    assert {p.kind for p in split.train} == {"scratchpad"}


# The default task's problems for the shipped config (seed 0, 4000 + 300), hashed before the scratchpad mode existed.
DEFAULT_TASK_SHA256 = "d16df7e607bd4a976e86bb3d5f2c4811615f3ce9f971527b32e7364407cb06ba"


def _digest(split) -> str:
    rows = [split.train_rows(), split.heldout_rows(), [p.solution for p in split.train + split.heldout]]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def test_the_default_task_is_byte_identical():
    config = load_config(None, ["model.source=tiny", "data.source=synthetic", "data.synthetic.num_train=4000",
                                "data.synthetic.num_heldout=300"])
    assert config.data.synthetic.mode == "arith"
    assert _digest(synthetic_split(config)) == DEFAULT_TASK_SHA256
    # Control: the digest tells another task from it.
    assert _digest(synthetic_split(load_config(None, [*SCRATCHPAD, "data.synthetic.num_train=4000",
                                                      "data.synthetic.num_heldout=300"]))) != DEFAULT_TASK_SHA256


@pytest.mark.parametrize("override,message", [
    ("data.synthetic.mode=scratch", r"data.synthetic.mode: .*'scratch'"),
    ("data.synthetic.scratchpad.min_terms=1", r"data.synthetic.scratchpad.min_terms: must be >= 2, got 1"),
    ("data.synthetic.scratchpad.max_terms=1", r"data.synthetic.scratchpad.max_terms: must be >= min_terms \(2\), "
                                              r"got 1"),
])
def test_bad_values_are_config_errors_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*SCRATCHPAD, override])
    load_config(None, SCRATCHPAD)  # control: the same config without the bad value loads


def test_impossible_requests_are_errors():
    with pytest.raises(ValueError, match="min_terms and max_terms"):
        ScratchpadTaskConfig(5, 4)
    with pytest.raises(ValueError, match="n_heldout=500 is too many for this task"):
        make_scratchpad_split(seed=0, n_train=0, n_heldout=500, config=ScratchpadTaskConfig(2, 2))  # 100+ exprs
