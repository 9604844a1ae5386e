"""A tiny tokenizer for the CPU models, trained locally with ``tokenizers`` and saved as a ``transformers`` tokenizer.

Vocabulary (118 entries, at most ``TINY_VOCAB_LIMIT``):
- special tokens, ids 0-5: ``<|pad|>``, ``<|endoftext|>`` (eos), ``<|user|>``, ``<|assistant|>``, ``<|system|>``,
  ``<|unk|>``;
- every printable ASCII character plus ``\\n`` and ``\\t`` (97 single characters), so any ASCII math text tokenizes;
  other characters become ``<|unk|>``;
- BPE merges learned only inside runs of letters of the synthetic prompts and solutions (``What``, ``is``,
  ``Compute``, ``Answer``). Digits, operators, spaces and punctuation are always single tokens: the pre-tokenizer
  isolates every non-letter character, so no merge can glue digits together and arithmetic stays digit by digit.

The chat template is ``<|user|>{content}<|assistant|>{content}<|endoftext|>`` with no separators; the assistant part
is wrapped in ``{% generation %}`` so ``return_assistant_tokens_mask=True`` marks the response tokens. The CPU path
therefore goes through the same ``apply_chat_template`` code as a real model. Training is deterministic: the corpus
comes from the synthetic generator with a fixed seed, and BPE breaks count ties by token ids.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from dapo_megatron.data.synthetic import PROMPT_TEMPLATES, make_split

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SYSTEM_TOKEN = "<|system|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN, UNK_TOKEN)
TINY_VOCAB_LIMIT = 128
ALPHABET = tuple(c for c in string.printable if c not in "\r\x0b\x0c")
_CORPUS_SEED = 0
_CORPUS_PROBLEMS = 3000

TINY_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}" + SYSTEM_TOKEN + "{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}" + USER_TOKEN + "{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}" + ASSISTANT_TOKEN + ""
    "{%- generation -%}{{ message['content'] }}" + EOS_TOKEN + "{%- endgeneration -%}"
    "{%- else -%}{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ASSISTANT_TOKEN + "{%- endif -%}"
)


def _training_corpus() -> list[str]:
    split = make_split(seed=_CORPUS_SEED, n_train=_CORPUS_PROBLEMS, n_heldout=0)
    corpus = [template.format(expression="1+2") for template in PROMPT_TEMPLATES.values()]
    for problem in split.train:
        corpus.append(problem.prompt_text)
        corpus.append(problem.solution)
    return corpus


def train_tiny_tokenizer() -> Tokenizer:
    """The raw ``tokenizers.Tokenizer``: character alphabet plus letter-run BPE merges."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[A-Za-z]+|[^A-Za-z]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_LIMIT,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=list(ALPHABET),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer)
    return tokenizer


def build_tiny_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerBase:
    """Train, save to ``out_dir`` as a ``transformers`` tokenizer with the chat template, and load it back."""
    out_dir = Path(out_dir)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=train_tiny_tokenizer(),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN],
        chat_template=TINY_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    wrapped.save_pretrained(str(out_dir))
    return AutoTokenizer.from_pretrained(str(out_dir))
