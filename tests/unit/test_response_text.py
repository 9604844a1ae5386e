"""The reward's response text: one batched decode gives exactly what decoding each response gives."""

from __future__ import annotations

import random

import pytest
from tiny_models import build_tiny_tokenizer
from transformers import PreTrainedTokenizerFast

from dapo_megatron.data.tokenizer import build_tiny_tokenizer as build_package_tokenizer
from dapo_megatron.reward.response_text import response_texts


def _random_responses(tokenizer, count: int = 24) -> list[list[int]]:
    rng = random.Random(0)
    # every id, special ones included, in any order: byte-level pieces that split a UTF-8 character too
    return [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 300))] for _ in range(count)]


@pytest.mark.parametrize("which", ["byte_level_bpe", "package_tiny"])
def test_batched_decode_equals_decoding_each_response(which, tmp_path, monkeypatch):
    tokenizer = build_tiny_tokenizer() if which == "byte_level_bpe" else build_package_tokenizer(tmp_path)
    responses = _random_responses(tokenizer)
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]
    calls = []
    monkeypatch.setattr(type(tokenizer), "decode", lambda *a, **k: calls.append(1))
    assert response_texts(tokenizer, responses) == expected
    assert not calls  # it took the batched path: the per-response decode was never called


def test_a_tokenizer_with_clean_up_decodes_each_response():
    tokenizer = build_tiny_tokenizer()
    cleaning = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer,
                                       clean_up_tokenization_spaces=True)
    cleaning.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True  # as WordPiece would
    responses = [cleaning.encode("a . b ,c ?", add_special_tokens=False)]
    backend_text = cleaning.backend_tokenizer.decode(responses[0])
    cleaned = cleaning.decode(responses[0], skip_special_tokens=True)
    assert cleaned != backend_text  # the control: here the batched backend decode would give another text
    assert response_texts(cleaning, responses) == [cleaned]
