"""A tiny random Hugging Face causal LM, built locally for tests (no hub access).

``build_tiny_qwen2(directory)`` writes a complete HF model directory that both ``transformers`` and an SGLang
server load offline: ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32) and a byte-level
BPE tokenizer trained here with ``tokenizers`` on a small arithmetic/English corpus, saved as a
``PreTrainedTokenizerFast`` with a Qwen-style chat template.

The weights are drawn with ``initializer_range=0.3`` (instead of the usual 0.02) so that next-token logits are
spread out: greedy decoding then has clear winners, and two implementations of the same forward pass (HF vs.
SGLang) pick the same token instead of flipping near-ties on rounding noise.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path

import torch

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyQwen2Spec:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    vocab_size: int | None = None  # None: exactly the tokenizer's size (every sampled id decodes)
    initializer_range: float = 0.3
    seed: int = 0


def tiny_hf_config(arch: str, *, vocab_size: int = 101, num_heads: int = 6, num_kv_heads: int = 2,
                   tie_word_embeddings: bool = False, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6):
    """A tiny ``Qwen2Config`` ("qwen2") / ``LlamaConfig`` ("llama"): hidden 48, 4 layers, head_dim 8, ffn 96 (fp32)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=48, num_hidden_layers=4, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, intermediate_size=96, tie_word_embeddings=tie_word_embeddings,
                  rms_norm_eps=rms_norm_eps, max_position_embeddings=256,
                  rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    if arch == "qwen2":
        return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    return LlamaConfig(**common, architectures=["LlamaForCausalLM"])


def save_random_hf_model(model_dir: str | Path, config, seed: int):
    """A random fp32 HF model of ``config`` saved as safetensors (returned, eval mode): norms (Qwen3's q/k norms too)
    and biases perturbed so a wrong mapping of them shows, a MoE router's weights spread so experts are chosen by clear
    margins. (No family has both biases and a router, so each family's draws are what they were before the merge.)"""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config.initializer_range = 0.05
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.05)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model


def _training_corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = (
        "what is the answer compute sum of and plus minus times equals question reasoning step first then "
        "finally so we get number result check"
    ).split()
    lines = []
    for _ in range(400):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        lines.append(f"What is {a}{op}{b}? Answer: {eval(f'{a}{op}{b}')}")
        lines.append(" ".join(rng.choice(words) for _ in range(8)))
    return lines


def build_tiny_tokenizer(seed: int = 0):
    """A byte-level BPE tokenizer (~300 tokens) trained on a fixed corpus; deterministic for a given seed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_qwen2(directory: str | Path, spec: TinyQwen2Spec = TinyQwen2Spec()) -> Path:
    """Write a tiny random fp32 ``Qwen2ForCausalLM`` with its tokenizer to ``directory`` and return the path."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(spec.seed)
    vocab_size = len(tokenizer) if spec.vocab_size is None else spec.vocab_size
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={vocab_size}")
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def perturbed_state_dict(model_dir: str | Path, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """The model's HF state dict with Gaussian noise of std ``scale`` added to every weight (fp32)."""
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(seed)
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    return {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        for name, tensor in state.items()
    }


def load_hf_model(model_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None):
    """The HF model from ``model_dir`` (fp32, eval), optionally with ``state_dict`` loaded over its weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if unexpected or [name for name in missing if "rotary" not in name]:
            raise ValueError(f"state dict does not fit the model: missing={missing} unexpected={unexpected}")
    return model


def sample_prompts(model_dir: str | Path, count: int, seed: int = 1) -> list[list[int]]:
    """``count`` short chat-formatted arithmetic prompts as token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    prompts = []
    for a, b in itertools.islice(((rng.randint(0, 99), rng.randint(0, 99)) for _ in itertools.count()), count):
        messages = [{"role": "user", "content": f"What is {a}+{b}?"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def hf_greedy(model, prompt: list[int], max_new_tokens: int, *, stop_at_eos: bool = False) -> list[int]:
    """HF's greedy continuation of one prompt, every position attended: exactly ``max_new_tokens`` tokens, or up to
    the model's EOS with ``stop_at_eos`` (what an SGLang server returns)."""
    stop = {} if stop_at_eos else {"eos_token_id": None}
    with torch.no_grad():
        output = model.generate(input_ids=torch.tensor([prompt]),
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64), do_sample=False,
                                max_new_tokens=max_new_tokens, pad_token_id=0, **stop)
    return output[0, len(prompt):].tolist()
