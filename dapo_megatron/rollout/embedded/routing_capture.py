"""The embedded engine's routing, recorded as SGLang returns it (``algorithm.moe_routing_replay: replay_rollout``).

A mixture-of-experts HF model's routers (``mlp.gate`` of every decoder layer, transformers' ``Qwen3MoeTopKRouter``,
which returns ``(logits, scores, indices)``) get a forward hook that keeps the top-k expert ids of the forward in
progress. :meth:`RoutingCapture.take` hands them over as ``[rows, positions, layers, k]`` int16 for the rows and
positions of that forward (the prefill's prompts, or one decode step's tokens); :mod:`.decode_chunk` stores them per
row, and a finished row's routing is that of its prompt and every generated token but the last
(``[P + R − 1, L, k]``): the last sampled token never goes through the model — SGLang's ``routed_experts`` covers
the same tokens.

The engine's streaming thread and a synchronous ``generate`` (validation in async mode) run forwards of the same
model at the same time, so what a hook keeps, and a prefill's ``routing``, belong to the thread whose forward it is.
"""

from __future__ import annotations

import threading

import torch


def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every decoder layer's router, in layer order (none for a dense model)."""
    layers = model.model.layers
    gates = [getattr(layer.mlp, "gate", None) for layer in layers]
    return gates if all(gate is not None and hasattr(gate, "top_k") for gate in gates) else []


class RoutingCapture:
    """Forward hooks on ``model``'s routers; ``take`` after each forward (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.gates = moe_gates(model)
        if not self.gates:
            raise ValueError("routing capture needs a mixture-of-experts model (every layer's mlp.gate a router)")
        self.topk = self.gates[0].top_k
        self._local = threading.local()  # per thread: ``last`` (a forward's ids per layer), ``routing``
        self._hooks = [gate.register_forward_hook(self._keep(i)) for i, gate in enumerate(self.gates)]

    def _keep(self, layer: int):
        def hook(module, args, output) -> None:
            self._kept()[layer] = output[2].to(torch.int16)  # (logits, scores, indices [tokens, k])
        return hook

    def _kept(self) -> list[torch.Tensor | None]:
        if not hasattr(self._local, "last"):
            self._local.last = [None] * len(self.gates)
        return self._local.last

    @property
    def routing(self) -> torch.Tensor | None:
        """This thread's last prefill's expert ids, per row (set by decode_batch.prefill)."""
        return getattr(self._local, "routing", None)

    @routing.setter
    def routing(self, value: torch.Tensor | None) -> None:
        self._local.routing = value

    @property
    def num_layers(self) -> int:
        return len(self.gates)

    def take(self, rows: int, positions: int) -> torch.Tensor:
        """The last forward's expert ids as ``[rows, positions, layers, k]`` int16 (its tokens are row-major)."""
        kept = self._kept()
        if any(last is None for last in kept):
            raise RuntimeError("routing capture: a router did not run in the last forward")
        routing = torch.stack(kept, dim=1).reshape(rows, positions, len(self.gates), self.topk)
        self._local.last = [None] * len(self.gates)
        return routing

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
