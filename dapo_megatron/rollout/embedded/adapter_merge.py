"""The embedded engine's LoRA adapters: merged into its weights, from a copy of the base it keeps.

The embedded engine decodes with the HF model's weights directly (:mod:`.lean_decode` skips the modules' forwards),
so an adapter is merged rather than applied on the side: every module it is on gets ``W_base + (alpha / r) · B A``
(float32), computed from the base weights as the last full :meth:`~.engine.EmbeddedEngine.update_weights` left them,
which :class:`AdapterMerge` copies the first time an adapter touches them (only the adapted modules' weights). A
module an earlier adapter was on and this one is not gets its base back. A new full update makes a new base.
"""

from __future__ import annotations

import torch

from dapo_megatron.hf_format.peft_adapter import PeftAdapter
from dapo_megatron.rollout.embedded.named_tensors import checkpoint_targets


class AdapterMerge:
    """The base weights of the modules adapters were merged into (see the module docstring)."""

    def __init__(self) -> None:
        self._base: dict[str, torch.Tensor] = {}

    def new_base(self) -> None:
        """The model now holds new full weights: they are the base from here on."""
        self._base.clear()

    @torch.no_grad()
    def apply(self, model: torch.nn.Module, adapter: PeftAdapter) -> None:
        """Merge ``adapter`` into ``model``'s weights (see the module docstring); a module it names that the model
        does not have, or whose factors do not fit the weight, is a ``ValueError`` naming them, before any weight
        changes."""
        targets = checkpoint_targets(model)
        unknown = [name for name in adapter.modules if name not in targets]
        misfit = [f"{name}: B A is [{adapter.factors(name)[1].shape[0]}, {adapter.factors(name)[0].shape[1]}], the "
                  f"weight {list(targets[name].shape)}" for name in adapter.modules if name in targets
                  and (adapter.factors(name)[1].shape[0], adapter.factors(name)[0].shape[1]) != targets[name].shape]
        if unknown or misfit:
            raise ValueError(f"the LoRA adapter does not fit the model: modules it does not have: {unknown[:10]}; "
                             f"shapes: {misfit[:10]}")
        for name in adapter.modules:
            if name not in self._base:
                self._base[name] = targets[name].detach().clone()
        for name, base in self._base.items():
            merged = base if name not in adapter.modules else base.float() + adapter.delta(name, base.device)
            targets[name].copy_(merged)
