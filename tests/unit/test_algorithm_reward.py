"""The DAPO math reward: extraction of the last `Answer:`, Minerva-style normalization, exact compare."""

import random
import sys
import threading

import pytest
import torch

from dapo_megatron.reward.rule import RewardResult, math_reward, normalize_answer

torch.set_num_threads(1)

FILLER = "We compute the sum step by step and check every case carefully. " * 40

# (response, ground truth, expected correctness)
CASES = [
    ("Answer: 18", "18", True),
    (FILLER + "\nAnswer: 18", "18", True),
    ("Answer: 18 cm", "18", True),
    ("Answer: 18 dollars", "18", True),
    ("Answer: \\text{18 inches}", "18", True),
    ("Answer: 18\\text{ cm}", "18", True),
    ("Answer: 90^\\circ", "90", True),
    ("Answer: 90 degrees", "90", True),
    ("Answer: 5^{\\mathrm{th}}", "5", True),
    ("Answer: \\$18", "18", True),
    ("Answer: $18$", "18", True),
    ("Answer: the total is $18$.", "18", True),
    ("Answer: \\boxed{18}", "18", True),
    ("Answer: $\\boxed{18}$", "18", True),
    ("Answer: 18", "\\boxed{18}", True),
    ("Answer: 1,234", "1234", True),
    ("Answer: 1234", "1,234", True),
    ("Answer: 12,345,678", "12345678", True),
    ("Answer: 1{,}000", "1000", True),
    ("Answer: 10,\\!000", "10000", True),
    ("Answer: 1,2", "12", False),  # a list, not a thousands separator
    ("Answer: 42.", "42", True),
    ("Answer: 42 because the sum is even", "42", False),  # trailing text makes the answer wrong
    ("Answer: 5\nWait, let me recheck.\nAnswer: 7", "7", True),  # the last Answer line counts
    ("Answer: 5\nWait, let me recheck.\nAnswer: 7", "5", False),
    ("The result is 18.", "18", False),  # no Answer line
    ("", "18", False),
    ("", "", False),  # no answer never matches, not even an empty ground truth
    ("Answer:", "", False),
    ("Answer:\n18", "18", True),  # \s* after the colon crosses the line break
    ("Answer: 18\n" + FILLER, "18", False),  # the answer is outside the last 300 characters
    ("x" * 100_000 + "\nAnswer: 18", "18", True),
    ("Answer: -7", "-7", True),
    ("Answer: -7", "7", False),
    ("Answer: x = -7", "-7", True),
    ("Answer: $x = 18$", "18", True),
    ("answer: 18", "18", True),
    ("ANSWER : 18", "18", True),
    ("The final answer: 18", "18", True),
    ("**Answer:** 18", "18", False),  # markdown around the keyword is not stripped by the rule
    ("Answer: \\frac{1}{2}", "\\frac12", True),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", True),
    ("Answer: \\frac1{2}", "\\frac{1}{2}", True),
    ("Answer: \\sqrt2", "\\sqrt{2}", True),
    ("Answer: 0.5", "\\frac{1}{2}", False),  # no numeric equivalence
    ("Answer: 18.0", "18", False),
    ("Answer: 2", "\\frac{4}{2}", False),
    ("Answer: 180", "18", False),
    ("Answer: 18", "180", False),
    ("Answer: \\left(1,2\\right)", "\\left(1,2\\right)", True),  # 'ft' in \left is not a unit
    ("Réponse finale — Answer: 18", "18", True),
    ("答案 Answer: 18", "18", True),
    ("Answer: 18 ✓", "18", False),
    ("Answer：18", "18", False),  # full-width colon is not the ASCII keyword
    ("Answer: −7", "-7", False),  # U+2212 minus is not '-': exact compare
]


@pytest.mark.parametrize("response,ground_truth,expected", CASES)
def test_math_reward_cases(response, ground_truth, expected):
    result = math_reward(response, ground_truth)
    assert isinstance(result, RewardResult)
    assert result.acc is expected
    assert result.score == (1.0 if expected else -1.0)


def test_case_count_meets_brief():
    assert len(CASES) >= 40


def test_pred_is_the_normalized_answer():
    assert math_reward("Answer: \\$1,234 dollars", "1234").pred == "1234"
    assert math_reward("Answer: 5\nAnswer: \\boxed{7}", "7").pred == "7"
    assert math_reward("no answer", "7").pred == ""


@pytest.mark.parametrize(
    "raw,normalized",
    [
        ("18", "18"),
        ("  18  ", "18"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\text{(A)}", "(A)"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\tfrac{3}{4}", "\\frac{3}{4}"),
        ("3\\sqrt2", "3\\sqrt{2}"),
        ("\\frac\\pi2", "\\frac{\\pi}{2}"),
        ("\\frac\\", "\\frac{\\}"),  # truncated input: no crash
        ("y = 2x + 1", "2x+1"),
        ("-1,000,000.5", "-1000000.5"),
        ("\\boxed{1", "1"),  # unbalanced brace: takes the rest, does not raise
    ],
)
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_non_string_input_is_a_type_error_naming_the_argument():
    with pytest.raises(TypeError, match="ground_truth"):
        math_reward("Answer: 18", 18)
    with pytest.raises(TypeError, match="response"):
        math_reward(None, "18")


def _random_text(rng: random.Random) -> str:
    latex = ["\\$", "\\boxed{", "\\text{", "\\frac", "\\sqrt", "\\", "^\\circ", "{,}", "\\!"]
    plain = ["Answer:", "answer :", "=", "$", "{", "}", ",", ".", " ", "\n", "-", "cm"]
    unusual = ["é", "答", "\x00", "\ud800", "🙂"]
    atoms = latex + plain + unusual + list("0123456789abcxyz")
    return "".join(rng.choice(atoms) for _ in range(rng.randint(0, 60)))


def test_fuzz_never_raises():
    rng = random.Random(0)
    for _ in range(3000):
        response, ground_truth = _random_text(rng), _random_text(rng)
        result = math_reward(response, ground_truth)
        assert result.score in (1.0, -1.0)
        assert result.acc is (result.score == 1.0)
        # a response that states the normalized ground truth is graded correct whenever it normalizes to itself
        expected = normalize_answer(ground_truth)
        if expected and "\n" not in expected and normalize_answer(expected) == expected:
            assert math_reward("Answer: " + expected, ground_truth).acc, (ground_truth, expected)


def test_math_verify_fallback_is_off_by_default_and_accepts_equivalents():
    pytest.importorskip("math_verify")
    assert not math_reward("Answer: 0.5", "\\frac{1}{2}").acc
    assert math_reward("Answer: 0.5", "\\frac{1}{2}", use_math_verify=True).acc
    assert math_reward("Answer: $\\sqrt{24}$", "2\\sqrt{6}", use_math_verify=True).acc
    boxed = math_reward("so the result is \\boxed{18}", "18", use_math_verify=True)
    assert boxed.acc and boxed.pred == "18"
    assert not math_reward("Answer: 19", "18", use_math_verify=True).acc
    assert not math_reward("", "18", use_math_verify=True).acc


def test_math_verify_fuzz_and_worker_thread_never_raise():
    pytest.importorskip("math_verify")
    rng = random.Random(1)
    for _ in range(40):
        math_reward(_random_text(rng), _random_text(rng), use_math_verify=True)

    results = []
    worker = threading.Thread(target=lambda: results.append(math_reward("Answer: 0.5", "1/2", use_math_verify=True)))
    worker.start()
    worker.join()
    assert results and results[0].acc


def test_math_verify_missing_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    assert math_reward("Answer: 18", "18").acc  # the default rule does not need the package
    with pytest.raises(ImportError, match="pip install math-verify"):
        math_reward("Answer: 18", "18", use_math_verify=True)  # fails fast, even before a fallback is needed
