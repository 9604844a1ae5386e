"""avg@k and best@k over scored samples, per source and overall."""

import re

import pytest

from dapo_megatron.data.dapo_math import load_dapo_math
from dapo_megatron.data.evaluation import ScoredSample, avg_at_k, score_samples
from dapo_megatron.data.fixtures import AIME_FIXTURE
from dapo_megatron.data.schema import validate_row


def last_line_answer_matches(response: str, ground_truth: str) -> float:
    """A toy scorer: 1.0 when the last line is exactly 'Answer: <ground truth>'."""
    match = re.fullmatch(r"Answer: (-?\d+)", response.strip().splitlines()[-1])
    return float(match is not None and match.group(1) == ground_truth)


def _problem(source, index, answer):
    raw = {"data_source": source, "prompt": [{"role": "user", "content": f"q{index}"}],
           "reward_model": {"ground_truth": answer}, "extra_info": {"index": index}}
    return validate_row(raw, source="toy", row=0, integer_answers=True)


def test_avg_and_best_at_k_on_a_toy_set():
    problems = [_problem("aime-2024", 0, "7"), _problem("aime-2024", 1, "12"), _problem("math_dapo", 0, "-3")]
    responses = [
        ["x\nAnswer: 7", "Answer: 8", "Answer: 7", "Answer: 7"],  # 3/4
        ["Answer: 1", "Answer: 2", "no answer", "Answer: 3"],  # 0/4
        ["Answer: -3", "Answer: -3\n", "Answer: 3", "Answer:-3"],  # 2/4
    ]
    report = avg_at_k(score_samples(problems, responses, last_line_answer_matches), k=4)
    assert report.k == 4
    assert report.per_source["aime-2024"].num_problems == 2
    assert report.per_source["aime-2024"].mean_at_k == pytest.approx((0.75 + 0.0) / 2)
    assert report.per_source["aime-2024"].best_at_k == pytest.approx(0.5)
    assert report.per_source["math_dapo"].mean_at_k == pytest.approx(0.5)
    assert report.per_source["math_dapo"].best_at_k == pytest.approx(1.0)
    assert report.overall.num_problems == 3
    assert report.overall.mean_at_k == pytest.approx((0.75 + 0.0 + 0.5) / 3)
    assert report.overall.best_at_k == pytest.approx(2 / 3)
    metrics = report.metrics()
    assert metrics["val-core/aime-2024/acc/mean@4"] == pytest.approx(0.375)
    assert metrics["val-core/math_dapo/acc/best@4"] == pytest.approx(1.0)
    assert metrics["val-core/all/acc/mean@4"] == pytest.approx(1.25 / 3)


def test_same_index_in_two_sources_are_two_problems():
    samples = [ScoredSample("a", 0, 1.0), ScoredSample("b", 0, 0.0)]
    report = avg_at_k(samples, k=1)
    assert report.overall.num_problems == 2 and report.overall.mean_at_k == 0.5


def test_aime_fixture_with_perfect_and_empty_responses():
    problems = load_dapo_math(AIME_FIXTURE).rows
    perfect = [[f"Answer: {p.ground_truth}"] * 2 for p in problems]
    report = avg_at_k(score_samples(problems, perfect, last_line_answer_matches), k=2)
    assert report.metrics()["val-core/aime-2024/acc/mean@2"] == 1.0
    silent = [["I don't know"] * 2 for _ in problems]
    assert avg_at_k(score_samples(problems, silent, last_line_answer_matches), k=2).overall.best_at_k == 0.0


def test_wrong_sample_count_and_bad_scores_are_errors():
    samples = [ScoredSample("s", 0, 1.0), ScoredSample("s", 0, 0.0), ScoredSample("s", 1, 1.0)]
    expected = "exactly 2 samples per problem; 1 problems differ, e.g. problem 1 of 's' has 1"
    with pytest.raises(ValueError, match=expected):
        avg_at_k(samples, k=2)
    with pytest.raises(ValueError, match="must be in \\[0, 1\\], got -1"):
        avg_at_k([ScoredSample("s", 0, -1.0)], k=1)
    with pytest.raises(ValueError, match="2 response lists for 1 problems"):
        score_samples([_problem("s", 0, "1")], [["a"], ["b"]], last_line_answer_matches)
    with pytest.raises(ValueError, match="at least one"):
        avg_at_k([], k=1)
