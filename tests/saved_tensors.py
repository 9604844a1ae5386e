"""What autograd keeps for backward: the memory tests' view of copies a forward pass should not make."""

from __future__ import annotations

import torch


def saved_during(fn):
    """``fn()``'s result and every tensor autograd saved for backward while it ran."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return result, saved


def logits_sized_copies(saved, logits: torch.Tensor) -> list[torch.Tensor]:
    """Saved tensors of vocabulary-wide rows that are not ``logits``' own memory."""
    own = logits.untyped_storage().data_ptr()
    return [t for t in saved if t.dim() and t.shape[-1] == logits.shape[-1] and t.untyped_storage().data_ptr() != own]
