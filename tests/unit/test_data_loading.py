"""Loading DAPO-Math-17K-schema files: jsonl and parquet, deduplication counts, malformed rows (error and skip)."""

import copy
import json
import logging

import pytest

from dapo_megatron.data.dapo_math import load_dapo_math, repeat_histogram, write_jsonl, write_parquet
from dapo_megatron.data.fixtures import AIME_FIXTURE, DAPO_MATH_FIXTURE
from dapo_megatron.data.schema import RowValidationError
from dapo_megatron.user_errors import DataError


def _fixture_rows(path=DAPO_MATH_FIXTURE):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _good_row(answer="12", index=None):
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": f"What is {answer} plus zero?"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index if index is not None else f"id-{answer}"},
    }


def _file_with_bad_row(tmp_path, mutate, bad_position=3, name="bad.jsonl"):
    rows = [_good_row(str(10 + i)) for i in range(6)]
    bad = copy.deepcopy(rows[bad_position])
    mutate(bad)
    rows[bad_position] = bad
    return write_jsonl(rows, tmp_path / name)


def test_fixture_jsonl_dedupes_with_counts():
    data = load_dapo_math(DAPO_MATH_FIXTURE)
    report = data.report
    assert (report.total_rows, report.valid_rows, report.unique_prompts) == (37, 37, 30)
    assert report.duplicate_rows == 7 and report.max_repeats == 4 and report.skipped_rows == 0
    assert sum(data.repeat_counts) == 37
    assert repeat_histogram(data) == {1: 26, 2: 2, 3: 1, 4: 1}
    raw = _fixture_rows()
    assert data.rows[0].ground_truth == raw[0]["reward_model"]["ground_truth"] == "91"
    assert data.repeat_counts[0] == 4
    # first-seen order and the first copy's index are kept
    assert data.rows[0].index == raw[0]["extra_info"]["index"]
    assert len({row.prompt_key for row in data.rows}) == 30
    assert any(row.ground_truth == "-50" for row in data.rows)


def test_fixture_prompts_follow_published_wording():
    for row in load_dapo_math(DAPO_MATH_FIXTURE).rows:
        (message,) = row.prompt
        assert message.role == "user"
        assert message.content.startswith("Solve the following math problem step by step. The last line of your")
        assert "Answer: $Answer" in message.content
        assert message.content.endswith('Remember to put your answer on its own line after "Answer:".')
        assert row.data_source == "math_dapo" and row.ability == "MATH"


def test_parquet_loads_the_same_rows_as_jsonl(tmp_path):
    parquet = write_parquet(_fixture_rows(), tmp_path / "dapo.parquet")
    from_parquet = load_dapo_math(parquet)
    from_jsonl = load_dapo_math(DAPO_MATH_FIXTURE)
    assert from_parquet.rows == from_jsonl.rows
    assert from_parquet.repeat_counts == from_jsonl.repeat_counts
    assert from_parquet.report.total_rows == 37


def test_aime_fixture_same_schema_integer_index():
    data = load_dapo_math(AIME_FIXTURE, integer_answers=True)
    assert len(data) == 6
    assert {row.data_source for row in data.rows} == {"aime-2024"}
    assert [row.index for row in data.rows] == list(range(6))
    assert all(0 <= int(row.ground_truth) <= 999 for row in data.rows)


def test_to_hf_dataset_round_trip(tmp_path):
    data = load_dapo_math(AIME_FIXTURE)
    path = tmp_path / "aime.parquet"
    data.to_hf_dataset().to_parquet(str(path))
    assert load_dapo_math(path).rows == data.rows


def _drop_ground_truth(row):
    del row["reward_model"]["ground_truth"]


def _set(path, value):
    def mutate(row):
        target = row
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


MALFORMED = {
    "missing answer": (_drop_ground_truth, "reward_model.ground_truth", "must be a string, got null"),
    "empty answer": (_set(["reward_model", "ground_truth"], "  "), "reward_model.ground_truth", "is empty"),
    "non-string content": (_set(["prompt", 0, "content"], 7), "prompt[0].content", "must be a string, got int"),
    "list content": (_set(["prompt", 0, "content"], [{"type": "text"}]), "prompt[0].content", "got list"),
    "empty messages": (_set(["prompt"], []), "prompt", "has no messages"),
    "prompt is a string": (_set(["prompt"], "hello"), "prompt", "must be a list"),
    "unknown role": (_set(["prompt", 0, "role"], "robot"), "prompt[0].role", "'robot'"),
    "no user message": (_set(["prompt", 0, "role"], "system"), "prompt", "no user message"),
    "non-integer answer": (_set(["reward_model", "ground_truth"], "3/4"), "reward_model.ground_truth", "integer"),
    "float answer": (_set(["reward_model", "ground_truth"], 2.5), "reward_model.ground_truth", "got float"),
    "missing data_source": (_set(["data_source"], None), "data_source", "non-empty string"),
    "reward_model not a mapping": (_set(["reward_model"], "34"), "reward_model", "got str"),
    "bad index type": (_set(["extra_info", "index"], [1]), "extra_info.index", "got list"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_row_error_names_file_row_and_field(tmp_path, case):
    mutate, field, problem = MALFORMED[case]
    path = _file_with_bad_row(tmp_path, mutate, bad_position=3, name="my_rows.jsonl")
    with pytest.raises(RowValidationError) as raised:
        load_dapo_math(path, integer_answers=True)
    error = raised.value
    assert (error.row, error.field) == (3, field)
    message = str(error)
    assert "my_rows.jsonl" in message and "row 3" in message and "line 4" in message
    assert f"field '{field}'" in message and problem in message


def test_error_names_extra_info_index(tmp_path):
    path = _file_with_bad_row(tmp_path, _set(["prompt", 0, "content"], None))
    with pytest.raises(RowValidationError, match=r"row 3 \(extra_info.index='id-13'\)"):
        load_dapo_math(path)


def test_non_integer_answer_allowed_without_integer_flag(tmp_path):
    path = _file_with_bad_row(tmp_path, _set(["reward_model", "ground_truth"], "\\frac{3}{4}"))
    data = load_dapo_math(path, integer_answers=False)
    assert data.rows[3].ground_truth == "\\frac{3}{4}"


def test_integer_ground_truth_value_is_accepted_as_string(tmp_path):
    path = _file_with_bad_row(tmp_path, _set(["reward_model", "ground_truth"], 13))
    assert load_dapo_math(path).rows[3].ground_truth == "13"


def test_invalid_json_line_is_named(tmp_path):
    path = tmp_path / "broken.jsonl"
    lines = [json.dumps(_good_row("1")), "", json.dumps(_good_row("2")), '{"data_source": "math_dapo", ']
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RowValidationError, match=r"broken.jsonl \(line 4\): row 2: field '<json>'"):
        load_dapo_math(path)


def test_a_line_that_is_not_utf8_is_named_and_skipped_in_skip_mode(tmp_path):
    """Issue 33.4: a Latin-1 byte in a jsonl was a UnicodeDecodeError traceback naming neither file nor line."""
    path = tmp_path / "latin1.jsonl"
    bad = json.dumps(_good_row("2"), ensure_ascii=False).replace("math_dapo", "math_dap\u00e9").encode("latin-1")
    good = [json.dumps(_good_row(answer)).encode() for answer in ("1", "3")]
    path.write_bytes(b"\n".join([good[0], bad, good[1]]) + b"\n")
    with pytest.raises(RowValidationError, match=r"latin1.jsonl \(line 2\): row 1: field '<utf-8>': not UTF-8 text "
                                                 r"\(byte 0xe9 at column \d+\)"):
        load_dapo_math(path)
    data = load_dapo_math(path, on_bad_row="skip")
    assert [row.ground_truth for row in data.rows] == ["1", "3"]
    assert data.report.skipped_by_reason == {"<utf-8>": 1} and data.report.total_rows == 3


def test_conflicting_duplicate_is_an_error(tmp_path):
    rows = [_good_row("5", index="a"), _good_row("6"), _good_row("5", index="b")]
    rows[2]["reward_model"]["ground_truth"] = "7"
    path = write_jsonl(rows, tmp_path / "conflict.jsonl")
    with pytest.raises(RowValidationError, match=r"row 2 .*'7' conflicts with '5' .* at row 0"):
        load_dapo_math(path)


def test_null_ground_truth_in_parquet_is_named(tmp_path):
    rows = [_good_row(str(i)) for i in range(4)]
    rows[2]["reward_model"]["ground_truth"] = None
    path = write_parquet(rows, tmp_path / "nulls.parquet")
    with pytest.raises(RowValidationError, match=r"nulls.parquet: row 2 .*field 'reward_model.ground_truth'"):
        load_dapo_math(path)


def test_skip_mode_counts_every_skip_and_logs(tmp_path, caplog):
    rows = [_good_row(str(i)) for i in range(10)]
    rows[1]["prompt"] = []
    rows[4]["prompt"][0]["content"] = 3
    del rows[6]["reward_model"]["ground_truth"]
    rows[7]["reward_model"]["ground_truth"] = "x+1"
    rows[9] = copy.deepcopy(rows[0])
    rows[9]["reward_model"]["ground_truth"] = "99"  # conflicting duplicate of row 0
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\nnot json\n")
    with caplog.at_level(logging.WARNING, logger="dapo_megatron.data.dapo_math"):
        data = load_dapo_math(path, on_bad_row="skip")
    report = data.report
    assert report.total_rows == 11
    assert report.skipped_rows == 6 and report.valid_rows == 5 and len(data) == 5
    assert report.skipped_by_reason == {
        "prompt": 1,
        "prompt[0].content": 1,
        "reward_model.ground_truth": 3,
        "<json>": 1,
    }
    assert [row.ground_truth for row in data.rows] == ["0", "2", "3", "5", "8"]
    assert "skipped 6 malformed rows" in caplog.text
    assert "row 4" in caplog.text and "prompt[0].content" in caplog.text


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="on_bad_row"):
        load_dapo_math(DAPO_MATH_FIXTURE, on_bad_row="drop")
    with pytest.raises(DataError, match="missing.jsonl: no such data file"):
        load_dapo_math(tmp_path / "missing.jsonl")
    other = tmp_path / "rows.csv"
    other.write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_dapo_math(other)
    broken = tmp_path / "rows.parquet"
    broken.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DataError, match="rows.parquet: not a readable parquet file"):
        load_dapo_math(broken)
