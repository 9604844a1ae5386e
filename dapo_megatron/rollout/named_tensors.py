"""Full HF-named tensors into a model's parameters, checked against it: how the embedded engine takes new weights."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from dapo_megatron.hf_format import TensorMismatch, WrongShape

_MAX_NAMES_IN_ERROR = 20


def load_named_tensors(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy full HF-named tensors into ``model``'s parameters, checking that they match it exactly.

    Every parameter must be provided once, with its exact shape, as a finite floating-point tensor. A parameter
    shared under several names (``lm_head.weight`` tied to ``model.embed_tokens.weight``) needs only one of them; if
    several are sent they must be equal. Tensors are copied (cast to the parameter's dtype) one at a time as the
    iterator yields them, so memory stays at what the producer holds beyond the model. All problems are collected
    and raised together as one ``ValueError`` naming the tensors; the model is then partially overwritten and must
    not serve.
    """
    name_to_param = dict(model.named_parameters(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for name, param in name_to_param.items():
        aliases.setdefault(id(param), []).append(name)

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
            already_loaded = [alias for alias in aliases[id(param)] if alias != name and alias in received]
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
