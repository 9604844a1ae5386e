"""Synthetic arithmetic: determinism, held-out disjointness, correct answers and consistent working lines."""

import ast
import operator
import re

import pytest

from dapo_megatron.data.dapo_math import load_dapo_math, write_jsonl
from dapo_megatron.data.synthetic import PROMPT_TEMPLATES, SyntheticTaskConfig, make_split

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """Integer value of an expression made of integers and + - * only (an independent check of the generator)."""

    def walk(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unexpected syntax in {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


@pytest.fixture(scope="module")
def split():
    return make_split(seed=123, n_train=600, n_heldout=200)


def test_same_seed_same_split_other_seed_differs(split):
    assert make_split(seed=123, n_train=600, n_heldout=200) == split
    assert make_split(seed=124, n_train=600, n_heldout=200) != split


def test_heldout_expressions_are_distinct_and_never_trained_on(split):
    heldout = [p.expression for p in split.heldout]
    assert len(heldout) == len(set(heldout)) == 200
    assert not set(heldout) & {p.expression for p in split.train}
    assert len(split.train) == 600


def test_answers_are_the_value_of_the_expression(split):
    for problem in split.train + split.heldout:
        assert problem.answer == evaluate(problem.expression)


def test_kinds_shapes_and_templates(split):
    problems = split.train + split.heldout
    chains = [p for p in problems if p.kind == "chain"]
    products = [p for p in problems if p.kind == "mul"]
    assert 0.2 < len(products) / len(problems) < 0.45
    for problem in chains:
        numbers = re.split(r"[+-]", problem.expression)
        assert len(numbers) in (3, 4) and all(len(n) == 1 for n in numbers)
    for problem in products:
        left, right = problem.expression.split("*")
        assert 10 <= int(left) <= 99 and 2 <= int(right) <= 9
    assert {len(re.split(r"[+-]", p.expression)) for p in chains} == {3, 4}
    assert {p.template for p in problems} == set(PROMPT_TEMPLATES)
    for problem in problems:
        assert problem.prompt_text == PROMPT_TEMPLATES[problem.template].format(expression=problem.expression)


def test_solution_lines_are_consistent(split):
    for problem in split.train + split.heldout:
        *steps, answer_line = problem.solution.split("\n")
        assert answer_line == f"Answer: {problem.answer}"
        results = []
        for step in steps:
            left, right = step.split("=")
            assert evaluate(left) == int(right), step
            results.append(int(right))
        assert results[-1] == problem.answer
        if problem.kind == "chain":
            numbers = re.findall(r"\d+", problem.expression)
            assert len(steps) == len(numbers) - 1
            assert steps[0].startswith(numbers[0])
            for previous_result, step in zip(results, steps[1:]):  # each step continues from the last result
                assert step.startswith(str(previous_result))
            assert min(results) >= 0  # allow_negative=False by default
        else:
            left, right = (int(x) for x in problem.expression.split("*"))
            assert steps == [
                f"{left // 10 * 10}*{right}={left // 10 * 10 * right}",
                f"{left % 10}*{right}={left % 10 * right}",
                f"{left // 10 * 10 * right}+{left % 10 * right}={left * right}",
            ]


def test_rows_follow_the_schema_and_load(split, tmp_path):
    path = write_jsonl(split.train_rows() + split.heldout_rows(), tmp_path / "synthetic.jsonl")
    data = load_dapo_math(path, integer_answers=True)
    assert data.report.skipped_rows == 0 and data.report.total_rows == 800
    heldout_rows = split.heldout_rows()
    assert heldout_rows[0]["prompt"] == [{"role": "user", "content": split.heldout[0].prompt_text}]
    assert heldout_rows[0]["reward_model"]["ground_truth"] == str(split.heldout[0].answer)
    assert heldout_rows[3]["extra_info"] == {
        "index": 3, "split": "heldout", "kind": split.heldout[3].kind, "expression": split.heldout[3].expression
    }


def test_difficulty_knobs():
    chains_of_three = SyntheticTaskConfig(mul_fraction=0.0, chain_lengths=(3,))
    only_chains = make_split(seed=0, n_train=200, n_heldout=0, config=chains_of_three)
    assert {p.kind for p in only_chains.train} == {"chain"}
    assert all(len(re.split(r"[+-]", p.expression)) == 3 for p in only_chains.train)
    negative_config = SyntheticTaskConfig(mul_fraction=0.0, allow_negative=True)
    negative = make_split(seed=0, n_train=300, n_heldout=0, config=negative_config)
    assert any(p.answer < 0 for p in negative.train)
    assert all(p.answer == evaluate(p.expression) for p in negative.train)
    only_bare_products = make_split(
        seed=0, n_train=50, n_heldout=0, config=SyntheticTaskConfig(mul_fraction=1.0, templates=("bare",))
    )
    assert all(p.kind == "mul" and p.prompt_text == f"{p.expression}=" for p in only_bare_products.train)


def test_impossible_requests_are_errors():
    tiny = SyntheticTaskConfig(mul_fraction=1.0, mul_left_range=(10, 11), mul_right_range=(2, 3))  # 4 expressions
    with pytest.raises(ValueError, match="only 4 distinct expressions"):
        make_split(seed=0, n_train=0, n_heldout=5, config=tiny)
    with pytest.raises(ValueError, match="held-out expressions cover"):
        make_split(seed=0, n_train=3, n_heldout=4, config=tiny)
    with pytest.raises(ValueError, match="mul_fraction"):
        SyntheticTaskConfig(mul_fraction=1.5)
    with pytest.raises(ValueError, match="templates"):
        SyntheticTaskConfig(templates=("riddle",))
