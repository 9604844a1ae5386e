"""The text the reward reads: each response's tokens decoded, special tokens skipped.

On trainer rank 0 this is the costliest part of scoring a step (a rule reads a 40 KB text in microseconds; the
decode of its ~10k tokens takes milliseconds): ``tokenizer.decode`` once per response runs in Python holding the GIL,
which rank 0's kernel launches wait on. A fast tokenizer that applies no clean-up after decoding gives the same text
from one ``decode_batch`` call of its Rust backend, which releases the GIL and spreads over cores
(``bench/bench_rank0_scoring.py``).
"""

from __future__ import annotations

from collections.abc import Sequence


def response_texts(tokenizer, responses: Sequence[Sequence[int]]) -> list[str]:
    """``[tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]``, in one batched call when the
    tokenizer allows (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # transformers' decode is the backend's decode followed by the clean-up, when a tokenizer asks for one (BERT's
    # "a ." -> "a."); Qwen's and the tiny tokenizers ask for none.
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]
    return backend.decode_batch(responses, skip_special_tokens=True)


def grouped_response_texts(tokenizer, groups: Sequence[Sequence]) -> list[list[str]]:
    """:func:`response_texts` of groups of samples (anything with ``token_ids``), in one call, grouped as given."""
    texts = iter(response_texts(tokenizer, [sample.token_ids for group in groups for sample in group]))
    return [[next(texts) for _ in group] for group in groups]
