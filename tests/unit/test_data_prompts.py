"""Chat-template prompt construction with the tiny tokenizer, and the max_prompt_length filter."""

import logging

import pytest
from transformers import PreTrainedTokenizerFast

from dapo_megatron.data.dapo_math import load_dapo_math
from dapo_megatron.data.fixtures import DAPO_MATH_FIXTURE
from dapo_megatron.data.prompts import build_prompt_records
from dapo_megatron.data.schema import validate_row
from dapo_megatron.data.synthetic import make_split
from dapo_megatron.data.tokenizer import build_tiny_tokenizer, train_tiny_tokenizer
from dapo_megatron.user_errors import ModelFolderError


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


def _synthetic_rows(n=12, seed=5):
    rows = make_split(seed=seed, n_train=n, n_heldout=0).train_rows()
    return [validate_row(row, source="synthetic", row=i, integer_answers=True) for i, row in enumerate(rows)]


def test_synthetic_prompt_text_and_ids(tokenizer):
    rows = _synthetic_rows()
    result = build_prompt_records(rows, tokenizer, max_prompt_length=64)
    assert result.num_filtered_too_long == 0 and len(result.records) == len(rows)
    for row, record in zip(rows, result.records):
        assert record.text == f"<|user|>{row.prompt[0].content}<|assistant|>"
        expected_ids = tokenizer.apply_chat_template(
            row.messages(), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert list(record.prompt_ids) == list(expected_ids)
        assert record.prompt_ids[0] == tokenizer.convert_tokens_to_ids("<|user|>")
        assert record.prompt_ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
        assert tokenizer.decode(record.prompt_ids) == record.text
        assert (record.ground_truth, record.data_source, record.index) == (row.ground_truth, row.data_source, row.index)
    # the synthetic prompt stays short: template text plus two role tokens
    assert result.longest_kept <= 20


def test_fixture_prompt_render(tokenizer):
    rows = load_dapo_math(DAPO_MATH_FIXTURE).rows
    result = build_prompt_records(rows, tokenizer, max_prompt_length=10_000)
    first = result.records[0]
    assert first.text.startswith("<|user|>Solve the following math problem step by step.")
    assert first.text.endswith('after "Answer:".<|assistant|>')
    assert first.ground_truth == "91" and first.data_source == "math_dapo"
    assert tokenizer.convert_tokens_to_ids("<|unk|>") not in first.prompt_ids


def test_system_message_rendered_before_user(tokenizer):
    raw = {
        "data_source": "x",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
        "reward_model": {"ground_truth": "4"},
    }
    row = validate_row(raw, source="inline", row=0, integer_answers=True)
    (record,) = build_prompt_records([row], tokenizer, max_prompt_length=64).records
    assert record.text == "<|system|>Be brief.<|user|>2+2=<|assistant|>"


def test_length_filter_counts_and_logs(tokenizer, caplog):
    rows = _synthetic_rows(n=40, seed=11)
    lengths = [len(r.prompt_ids) for r in build_prompt_records(rows, tokenizer, max_prompt_length=1000).records]
    limit = sorted(lengths)[len(lengths) // 2]
    expected_filtered = sum(length > limit for length in lengths)
    assert 0 < expected_filtered < len(rows)
    with caplog.at_level(logging.WARNING, logger="dapo_megatron.data.prompts"):
        result = build_prompt_records(rows, tokenizer, max_prompt_length=limit)
    assert result.num_filtered_too_long == expected_filtered
    assert len(result.records) == len(rows) - expected_filtered
    assert all(len(r.prompt_ids) <= limit for r in result.records)
    assert result.longest_kept == limit
    assert f"filtered {expected_filtered} of {len(rows)} prompts longer than max_prompt_length={limit}" in caplog.text


def test_tokenizer_without_chat_template_is_rejected():
    bare = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(), eos_token="<|endoftext|>")
    with pytest.raises(ModelFolderError, match="no chat_template"):
        build_prompt_records(_synthetic_rows(n=2), bare, max_prompt_length=64)
