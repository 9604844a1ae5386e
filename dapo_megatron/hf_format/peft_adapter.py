"""LoRA adapters in Hugging Face PEFT's format: the names, the config, the folder, and what an adapter does to the
base weights it is on.

PEFT saves a LoRA adapter of a causal LM as a folder with ``adapter_config.json`` and ``adapter_model.safetensors``,
whose tensors are named after the base model's modules with ``base_model.model.`` in front and ``lora_A`` /
``lora_B`` before ``.weight`` (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, ``[r, in]``;
``lora_B``: ``[out, r]``); the adapter adds ``(lora_alpha / r) · B A`` to the module's weight. SGLang 0.5.23's
``/load_lora_adapter_from_tensors`` takes the same names and the config as a dict, and so does the embedded engine
(:meth:`PeftAdapter.merged_into`). One :class:`PeftAdapter` is what the trainer's handoff sends, what
``checkpoint_tools`` exports and what tests load into HF's ``peft``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch

from dapo_megatron.hf_format.buckets import nbytes
from dapo_megatron.hf_format.folder import HFFormatError

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_FACTORS = {"A": "lora_A", "B": "lora_B"}


def peft_name(hf_weight_name: str, factor: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` → ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
    (``factor`` "A" or "B"); format templates (``{layer}``) pass through."""
    module, leaf = hf_weight_name.rsplit(".", 1)
    if leaf != "weight" or factor not in _FACTORS:
        raise ValueError(f"no LoRA {factor!r} for {hf_weight_name} (a module's weight, factor A or B)")
    return f"{PEFT_PREFIX}{module}.{_FACTORS[factor]}.weight"


def base_weight_name(name: str) -> tuple[str, str]:
    """Inverse of :func:`peft_name`: (the base weight's HF name, "A" or "B")."""
    body = name.removeprefix(PEFT_PREFIX)
    for factor, infix in _FACTORS.items():
        suffix = f".{infix}.weight"
        if body.endswith(suffix) and body != name:
            return body[: -len(suffix)] + ".weight", factor
    raise HFFormatError(f"{name!r} is not a PEFT LoRA tensor name ({PEFT_PREFIX}<module>.lora_A/lora_B.weight)")


@dataclass
class PeftAdapter:
    """A LoRA adapter by PEFT's names: full (unsplit) ``tensors``, ``rank`` and ``alpha`` (the scale is
    ``alpha / rank``); ``dropout`` only for the config a trainer records."""

    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: float
    dropout: float = 0.0
    base_model: str | None = None
    modules: list[str] = field(init=False)  # base weight names the adapter is on, in tensor order

    def __post_init__(self) -> None:
        pairs: dict[str, set[str]] = {}
        for name in self.tensors:
            base, factor = base_weight_name(name)
            pairs.setdefault(base, set()).add(factor)
        unpaired = [base for base, factors in pairs.items() if factors != {"A", "B"}]
        if unpaired:
            raise HFFormatError(f"LoRA adapter: {len(unpaired)} module(s) without both lora_A and lora_B: "
                                f"{unpaired[:5]}")
        self.modules = list(pairs)
        for base in self.modules:
            a, b = self.factors(base)
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != self.rank or b.shape[1] != self.rank:
                raise HFFormatError(f"LoRA adapter: {base}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are "
                                    f"not [r, in] and [out, r] with r = {self.rank}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def target_modules(self) -> list[str]:
        """The module names PEFT and SGLang match (``q_proj``, ``gate_proj``, ...)."""
        return sorted({base.rsplit(".", 2)[-2] for base in self.modules})

    @property
    def nbytes(self) -> int:
        return sum(nbytes(tensor) for tensor in self.tensors.values())

    def factors(self, base: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of the base weight ``base`` (its HF name)."""
        return self.tensors[peft_name(base, "A")], self.tensors[peft_name(base, "B")]

    def delta(self, base: str, device: torch.device | str | None = None) -> torch.Tensor:
        """``scale · B A`` for the base weight ``base``, in float32, computed on ``device`` (default: the factors'):
        the factors are small, the product is the weight's size."""
        a, b = (factor.to(device) for factor in self.factors(base))
        return (b.float() @ a.float()) * self.scale

    def merged_into(self, named_weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The base weights with the adapter merged into those it is on (``W + scale · B A``, computed in float32,
        returned in each weight's dtype); the others as they are."""
        targets = set(self.modules)
        for name, weight in named_weights:
            if name in targets:
                weight = (weight.float() + self.delta(name, weight.device)).to(weight.dtype)
            yield name, weight

    def config_dict(self) -> dict:
        """``adapter_config.json``'s content, as PEFT writes it for a LoRA adapter of a causal LM."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "lora_dropout": self.dropout, "target_modules": self.target_modules, "bias": "none",
                "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
                "modules_to_save": None, "base_model_name_or_path": self.base_model}


def write_peft_adapter(folder: str | Path, adapter: PeftAdapter) -> Path:
    """``folder/adapter_config.json`` and ``folder/adapter_model.safetensors`` (contiguous copies of the tensors)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.detach().contiguous() for name, tensor in adapter.tensors.items()},
              str(folder / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter.config_dict(), indent=2) + "\n")
    return folder


def read_peft_adapter(folder: str | Path) -> PeftAdapter:
    """A PEFT LoRA folder as :func:`write_peft_adapter` writes it (errors name the folder and what is wrong)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
        tensors = load_file(str(folder / ADAPTER_WEIGHTS_FILE))
    except (OSError, ValueError) as error:
        raise HFFormatError(f"{folder} is not a PEFT adapter folder: {error}") from None
    if config.get("peft_type") != "LORA":
        raise HFFormatError(f"{folder / ADAPTER_CONFIG_FILE}: peft_type {config.get('peft_type')!r}, expected 'LORA'")
    return PeftAdapter(tensors, rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                       dropout=float(config.get("lora_dropout", 0.0)), base_model=config.get("base_model_name_or_path"))
