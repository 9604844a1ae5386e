"""Full HF-named tensors into a model's parameters, checked against it: how the embedded engine takes new weights.

The names are the checkpoint's (what the handoff sends, what SGLang loads): a parameter's own name, except for the
experts of a mixture-of-experts layer, which ``transformers`` 5 keeps fused in memory — ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` (expert ``e``'s gate rows, then its up rows) and ``mlp.experts.down_proj`` ``[E, H, I]`` — while the
checkpoint stores ``mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj`` per expert (transformers'
``qwen2_moe`` conversion: stack the experts, concatenate gate and up). :func:`checkpoint_targets` maps each
checkpoint name to the parameter, or the view of one, it fills.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from dapo_megatron.hf_format import TensorMismatch, WrongShape

_MAX_NAMES_IN_ERROR = 20


def checkpoint_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint tensor name → the parameter or parameter view it fills (see the module docstring). A parameter
    shared under several names (tied embeddings) appears under each of them."""
    targets: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        experts = name.removesuffix("gate_up_proj").removesuffix("down_proj")
        if not (experts.endswith("experts.") and param.dim() == 3):
            targets[name] = param
        elif name.endswith("gate_up_proj"):
            half = param.shape[1] // 2
            for expert in range(param.shape[0]):
                targets[f"{experts}{expert}.gate_proj.weight"] = param[expert, :half]
                targets[f"{experts}{expert}.up_proj.weight"] = param[expert, half:]
        else:
            for expert in range(param.shape[0]):
                targets[f"{experts}{expert}.down_proj.weight"] = param[expert]
    return targets


def _storage_key(tensor: torch.Tensor) -> tuple:
    """The same elements of the same storage: two names of one tied parameter, never two experts' slices."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride()


def load_named_tensors(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy full HF-named tensors into ``model``'s parameters, checking that they match it exactly.

    Every checkpoint tensor of the model (:func:`checkpoint_targets`) must be provided once, with its exact shape,
    as a finite floating-point tensor. A parameter shared under several names (``lm_head.weight`` tied to
    ``model.embed_tokens.weight``) needs only one of them; if several are sent they must be equal. Tensors are copied
    (cast to the parameter's dtype) one at a time as the iterator yields them, so memory stays at what the producer
    holds beyond the model. All problems are collected and raised together as one ``ValueError`` naming the tensors;
    the model is then partially overwritten and must not serve.
    """
    name_to_param = checkpoint_targets(model)
    aliases: dict[tuple, list[str]] = {}
    for name, param in name_to_param.items():
        aliases.setdefault(_storage_key(param), []).append(name)

    received: set[str] = set()
    provided_twice: list[str] = []
    unexpected: list[str] = []
    wrong_shape: list[WrongShape] = []
    bad_values: list[str] = []
    tied_disagree: list[str] = []
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name in received:
                provided_twice.append(name)
                continue
            received.add(name)
            param = name_to_param.get(name)
            if param is None:
                unexpected.append(f"{name} {tuple(tensor.shape)}")
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                wrong_shape.append(WrongShape(name, tuple(tensor.shape), tuple(param.shape)))
                continue
            if not tensor.is_floating_point():
                bad_values.append(f"{name}: dtype {tensor.dtype} is not floating point")
                continue
            if not _all_finite(tensor):
                bad_values.append(f"{name}: contains NaN or inf")
                continue
            already_loaded = [alias for alias in aliases[_storage_key(param)] if alias != name and alias in received]
            if already_loaded and not torch.equal(param, tensor.to(param.dtype)):
                tied_disagree.append(f"{name} differs from {already_loaded[0]} (the model ties them)")
                continue
            param.copy_(tensor)

    mismatch = TensorMismatch(
        missing=[" / ".join(names) for names in aliases.values() if not any(name in received for name in names)],
        unexpected=unexpected,
        wrong_shape=wrong_shape,
        other={"provided more than once": provided_twice, "bad values": bad_values,
               "tied weights disagree": tied_disagree},
    )
    if mismatch:
        raise ValueError(mismatch.report(f"the tensors do not match {type(model).__name__}",
                                         max_names=_MAX_NAMES_IN_ERROR))


def _all_finite(tensor: torch.Tensor) -> bool:
    """NaN and ±inf reach the minimum or maximum: one read pass, no temporary the size of the tensor (which
    ``isfinite(t).all()`` makes, at several times the cost of the copy into the parameter)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))
