"""Tiny Qwen3 and Qwen3-MoE configs with the awkward shapes a mapping or a layout gets wrong first.

* ``head_dim`` 12 while ``hidden_size / heads`` is 8 (Qwen3 decouples them), 3 query heads per KV group, a
  vocabulary (101) no TP size divides;
* MoE: an odd number of experts (5) with top-3 routing; megatron splits experts evenly over expert-parallel ranks,
  so EP=2 needs an even count (``EVEN_EXPERTS`` = 6), and each expert's width (40) is not the dense one (96).

:func:`tiny_models.save_random_hf_model` perturbs every norm and spreads the router's logits, so a q/k norm mapped
wrong, or a router applied wrong, shows in the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

ODD_EXPERTS = 5
EVEN_EXPERTS = 6


def tiny_qwen3_config(*, tie_word_embeddings: bool = False, vocab_size: int = 101, num_layers: int = 4):
    """A ``Qwen3Config``: hidden 48, 6 heads of head_dim 12 over 2 KV heads, ffn 96, fp32."""
    from transformers import Qwen3Config

    return Qwen3Config(**_attention(vocab_size, num_layers, tie_word_embeddings), intermediate_size=96,
                       architectures=["Qwen3ForCausalLM"])


def tiny_qwen3_moe_config(*, num_experts: int = ODD_EXPERTS, topk: int = 3, norm_topk_prob: bool = True,
                          tie_word_embeddings: bool = False, vocab_size: int = 101, num_layers: int = 4):
    """A ``Qwen3MoeConfig`` with Qwen3's attention above and ``num_experts`` experts of width 40, top-``topk``."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_attention(vocab_size, num_layers, tie_word_embeddings), intermediate_size=96,
                          moe_intermediate_size=40, num_experts=num_experts, num_experts_per_tok=topk,
                          norm_topk_prob=norm_topk_prob, architectures=["Qwen3MoeForCausalLM"])


def _attention(vocab_size: int, num_layers: int, tie_word_embeddings: bool) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=48, num_hidden_layers=num_layers, num_attention_heads=6,
                num_key_value_heads=2, head_dim=12, tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-6,
                max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def build_tiny_qwen3_folder(directory: str | Path, *, moe: bool, seed: int = 0) -> Path:
    """A complete HF folder an SGLang server loads offline (config, generation config, fp32 safetensors, the tiny
    tokenizer of :mod:`tiny_models`): Qwen3, or Qwen3-MoE with 6 experts, top-2 (EP=2 splits them). Weights drawn
    with ``initializer_range=0.3`` as :func:`tiny_models.build_tiny_qwen2` does: greedy decoding has clear winners."""
    from tiny_models import END_OF_TEXT, IM_END, build_tiny_tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(seed)
    config = (tiny_qwen3_moe_config(num_experts=EVEN_EXPERTS, topk=2, vocab_size=len(tokenizer), num_layers=2)
              if moe else tiny_qwen3_config(vocab_size=len(tokenizer), num_layers=2))
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    config.max_position_embeddings = 512
    config.initializer_range = 0.3
    config.eos_token_id, config.pad_token_id, config.bos_token_id = eos_id, pad_id, None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_dormant_expert_model(directory: Path, *, num_experts: int, vocab_size: int = 101) -> Path:
    """Qwen3-MoE, 2 layers, top-2, whose expert 0 no token chooses: every router row is a fixed direction (0, v, −v,
    u, −u and, with 6 experts, 0.3·w), so a trainer copy that raises row 0 routes differently from this model."""
    from tiny_models import save_random_hf_model

    config = tiny_qwen3_moe_config(num_experts=num_experts, topk=2, vocab_size=vocab_size, num_layers=2)
    model = save_random_hf_model(directory, config, seed=3)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight  # [num_experts, hidden]
            v, u, *w = torch.randn(num_experts - 3, gate.shape[1], generator=torch.Generator().manual_seed(4)) * 0.5
            gate.copy_(torch.stack([torch.zeros_like(v), v, -v, u, -u] + [0.3 * row for row in w]))
    model.save_pretrained(directory, safe_serialization=True)
    return directory
