"""The tiny CPU tokenizer: size, determinism, round trips, special tokens, chat template masks."""

import pytest
from transformers import AutoTokenizer

from dapo_megatron.data.fixtures import DAPO_MATH_FIXTURE
from dapo_megatron.data.synthetic import make_split
from dapo_megatron.data.tokenizer import TINY_VOCAB_LIMIT, build_tiny_tokenizer


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tiny_tokenizer")
    return out_dir, build_tiny_tokenizer(out_dir)


def test_vocabulary_is_small_with_distinct_specials(built):
    _, tokenizer = built
    assert len(tokenizer) <= TINY_VOCAB_LIMIT
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.eos_token == "<|endoftext|>"
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    for token in ("<|user|>", "<|assistant|>", "<|system|>"):
        assert tokenizer.convert_tokens_to_ids(token) in tokenizer.all_special_ids
    assert "Answer" in tokenizer.get_vocab()


def test_build_is_deterministic(built, tmp_path):
    out_dir, _ = built
    build_tiny_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (out_dir / "tokenizer.json").read_bytes()
    assert (tmp_path / "tokenizer_config.json").read_bytes() == (out_dir / "tokenizer_config.json").read_bytes()


def test_round_trip_of_synthetic_solutions_with_single_digit_tokens(built):
    _, tokenizer = built
    for problem in make_split(seed=1, n_train=50, n_heldout=0).train:
        for text in (problem.solution, problem.prompt_text):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.decode(ids) == text
            tokens = tokenizer.convert_ids_to_tokens(ids)
            assert all(len(token) == 1 for token in tokens if any(c.isdigit() for c in token))
            assert "<|unk|>" not in tokens


def test_arbitrary_ascii_math_round_trips_and_non_ascii_is_unk(built):
    _, tokenizer = built
    text = DAPO_MATH_FIXTURE.read_text().splitlines()[5]
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    ids = tokenizer("x² = π", add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.unk_token_id) == 2


def test_saved_directory_reloads_with_auto_tokenizer(built):
    out_dir, tokenizer = built
    reloaded = AutoTokenizer.from_pretrained(str(out_dir))
    messages = [{"role": "user", "content": "Compute 47*6."}]
    assert reloaded.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    )


def test_chat_template_marks_response_and_eos(built):
    _, tokenizer = built
    problem = make_split(seed=2, n_train=1, n_heldout=0).train[0]
    messages = [{"role": "user", "content": problem.prompt_text}, {"role": "assistant", "content": problem.solution}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == f"<|user|>{problem.prompt_text}<|assistant|>{problem.solution}<|endoftext|>"
    encoded = tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True)
    ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    response_start = ids.index(tokenizer.convert_tokens_to_ids("<|assistant|>")) + 1
    assert mask == [0] * response_start + [1] * (len(ids) - response_start)
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[response_start:-1]) == problem.solution


def test_unknown_role_is_an_error(built):
    _, tokenizer = built
    with pytest.raises(Exception, match="unknown chat role: tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
