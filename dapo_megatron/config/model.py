"""``model:``: which policy is trained (an HF folder or a tiny random-init model) and how its layers run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dapo_megatron.config.errors import require, require_finite_numbers


@dataclass
class TinyModelConfig:
    """A random-init model built locally (the CPU demo and tests); used when ``model.source = tiny``. ``arch``:
    Qwen2-style (the default), Qwen3 (q/k norms, ``head_dim`` of its own) or Qwen3-MoE (Qwen3 attention, every MLP
    ``num_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per token)."""

    arch: Literal["qwen2", "qwen3", "qwen3_moe"] = "qwen2"
    hidden_size: int = 128
    num_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    head_dim: int | None = None  # qwen3 / qwen3_moe; null: hidden_size / num_attention_heads
    num_experts: int = 8  # qwen3_moe
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True


@dataclass
class MoEConfig:
    """Training settings of a mixture-of-experts policy (Qwen3-MoE); the model's shape comes from its config.json."""

    # Weight of megatron's Switch load-balancing loss per MoE layer, added to the policy loss. 0: the policy loss
    # alone (RL steps are small; balance is then only watched: actor/moe_aux_loss and actor/moe_load_imbalance are
    # logged either way). Qwen3-MoE was pretrained with 0.001 (its config's router_aux_loss_coef).
    aux_loss_coeff: float = 0.0

    def validate(self) -> None:
        """Called by :meth:`ModelConfig.validate`, which also checks that the numbers are finite."""
        require(self.aux_loss_coeff >= 0, "model.moe.aux_loss_coeff", f"must be >= 0, got {self.aux_loss_coeff}")


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy's linear layers, the base frozen (:mod:`dapo_megatron.policy.lora.adapter`).

    Off by default. On: every ``target_modules`` linear of every layer (a mixture-of-experts model's experts too)
    gets ``W x + (alpha / rank) · B A x`` with ``A`` ``[rank, in]`` (Kaiming-uniform) and ``B`` ``[out, rank]`` (zero),
    and only ``A`` and ``B`` train: no gradient buffer and no optimizer state exist for the base. The defaults follow
    "LoRA Without Regret" (Thinking Machines, 2025): every linear layer adapted, ``alpha`` 32 with the ``1 / rank``
    scale, no weight decay (``weight_decay``, in place of ``optim.weight_decay``). The learning rate stays the
    user's: ``lr_multiplier`` (applied to ``optim.lr``) is 1 unless set; the paper finds LoRA's best rate about 10x
    full fine-tuning's, and docs/lora.md measures 3x to 5x best on the CPU demo (the examples set 5x to 10x)."""

    enabled: bool = False
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0  # on each adapter's input, in training forwards only
    # megatron's names of the linears (one fused linear_qkv for q/k/v, one linear_fc1 for gate/up; an expert's
    # linear_fc1 / linear_fc2 count as linear_fc1 / linear_fc2)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    lr_multiplier: float = 1.0  # the adapters train at optim.lr x this
    # The adapters' decoupled weight decay, in place of optim.weight_decay (only the adapters train). 0 as in "LoRA
    # Without Regret" (and PEFT's and TRL's defaults): decay would pull B A toward the base, and A away from its
    # initial scale, at lr_multiplier times the full model's rate.
    weight_decay: float = 0.0
    # What reaches the rollout engine after each step: "adapter" (the adapter tensors alone; SGLang serves them by
    # name, the embedded engine merges them into its copy of the base) or "merged" (W + (alpha / rank) · B A, the
    # full weights, as without LoRA).
    handoff: Literal["adapter", "merged"] = "adapter"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        require(self.rank >= 1, "model.lora.rank", f"must be >= 1, got {self.rank}")
        require(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
        require(0 <= self.dropout < 1, "model.lora.dropout", f"must be in [0, 1), got {self.dropout}")
        require(self.lr_multiplier > 0, "model.lora.lr_multiplier", f"must be > 0, got {self.lr_multiplier}")
        require(self.weight_decay >= 0, "model.lora.weight_decay", f"must be >= 0, got {self.weight_decay}")
        unknown = [name for name in self.target_modules if name not in LORA_TARGETS]
        require(bool(self.target_modules) and not unknown, "model.lora.target_modules",
                f"must name some of {', '.join(LORA_TARGETS)}; got {self.target_modules}")
        require(len(set(self.target_modules)) == len(self.target_modules), "model.lora.target_modules",
                f"names a module twice: {self.target_modules}")


Kernels = Literal["auto", "transformer_engine", "local"]
Recompute = Literal["selective", "full", "none"]
Precision = Literal["fp32", "bf16", "fp8"]


@dataclass
class ModelConfig:
    source: Literal["hf", "tiny"] = "hf"
    hf_path: str | None = None  # HF folder: config.json, safetensors, tokenizer files
    tokenizer_path: str | None = None  # defaults to hf_path (tiny: a tokenizer trained locally)
    precision: Precision = "bf16"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    # Activation recomputation on GPU (policy/model.py): "selective" recomputes the core attention in backward
    # (megatron's default selective set: the attention scores/softmax are what it would otherwise keep); "full" keeps
    # only each layer's input and recomputes the whole layer; "none" keeps everything. Without CUDA it is off (memory
    # is not the limit there, it would only cost time). `dapo-megatron plan CONFIG` shows the memory per GPU.
    recompute: Recompute = "selective"
    # The policy's layers on CUDA (dapo_megatron.backend): "auto" takes Transformer Engine when it imports, else
    # megatron's local layers with torch's SDPA attention, and logs that; "transformer_engine" refuses to start
    # without it; "local" takes the local layers on purpose. Without CUDA the CPU layers run (dapo_megatron.cpu).
    kernels: Kernels = "auto"
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def validate(self) -> None:
        require_finite_numbers(self, "model.")
        self.moe.validate()
        self.lora.validate()
        require(self.source == "tiny" or bool(self.hf_path), "model.hf_path", "is required when model.source = hf")
