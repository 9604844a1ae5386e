"""The names of LoRA adapters' parameters next to the linears they are on (:mod:`.adapter`), apart from
the adapters themselves so that checkpoint and conversion code can tell them by name without importing megatron:
the adapter on ``...self_attention.linear_qkv`` is ``...self_attention.linear_qkv_lora`` with ``lora_a`` and
``lora_b``."""

from __future__ import annotations

ADAPTER_SUFFIX = "_lora"


def adapter_module_name(linear_name: str) -> str:
    """``linear_qkv`` → ``linear_qkv_lora``: the adapter's attribute name next to its linear."""
    return linear_name + ADAPTER_SUFFIX


def is_adapter_parameter(name: str) -> bool:
    """Whether a parameter name (``...linear_qkv_lora.lora_a``) is an adapter's."""
    module = name.rsplit(".", 2)
    return len(module) == 3 and module[1].endswith(ADAPTER_SUFFIX) and module[2] in ("lora_a", "lora_b")


def adapter_parameter_names(base_weight_name: str) -> tuple[str, str]:
    """The names of the ``lora_a`` and ``lora_b`` of the adapter on the linear whose weight is ``base_weight_name``
    (``decoder.layers.0.self_attention.linear_qkv.weight``; a grouped linear's ``weight{expert}`` keeps its suffix)."""
    module, leaf = base_weight_name.rsplit(".", 1)
    if not leaf.startswith("weight"):
        raise ValueError(f"{base_weight_name} is not a linear's weight")
    adapter, suffix = adapter_module_name(module), leaf.removeprefix("weight")
    return f"{adapter}.lora_a{suffix}", f"{adapter}.lora_b{suffix}"
