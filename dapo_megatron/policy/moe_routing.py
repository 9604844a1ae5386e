"""The routers of a mixture-of-experts policy: what they chose (load statistics) and replaying π_old's choices.

Both work through forward hooks on this pipeline stage's megatron ``TopKRouter`` modules (:func:`moe_routers`, in
layer order); nothing in megatron is changed.

:class:`RouterLoadMonitor` — during an optimizer update's forward passes, per layer: how many tokens each expert got
(``f_i``, the share of the layer's ``T · k`` assignments) and the mean router probability of each expert (``P_i``,
softmax over all experts, float32). Summed over every DP/EP rank (and TP ranks under sequence parallelism, where each
sees its share of the tokens) and gathered over the pipeline stages, they give

* ``moe_aux_loss`` — the Switch load-balancing loss ``E · Σ_i f_i P_i`` of the update's routing, averaged over the
  layers (1.0 when both are uniform). It is what megatron's "aux_loss" adds to the objective, times
  ``model.moe.aux_loss_coeff``, and it is logged whether or not that coefficient is 0;
* ``moe_load_imbalance`` — the most loaded expert's share over the mean share, ``max_i f_i · E``, the worst layer's
  (1.0: perfectly balanced; ``E / k`` would be every token on the same k experts), and the same per layer.

:class:`RoutingReplay` — ``algorithm.moe_routing_replay: replay_old``. megatron-core 0.16.1's ``RouterReplay``
(``transformer/moe/router_replay.py``, one per router when ``moe_enable_routing_replay``) records the top-k expert
indices of a forward (action RECORD) and, with REPLAY_FORWARD, routes a forward with given indices instead of its
own top-k: the probabilities are still the current router's, gathered at those indices. :meth:`RoutingReplay.recording`
keeps the indices of every forward of a pass, per router, one entry per micro-batch in the order they ran;
:meth:`RoutingReplay.replaying` hands them back in the same order. A micro-batch must therefore hold the same tokens
in both passes: the π_old pass runs the update's very mini-batch with the update's batching
(:class:`dapo_megatron.trainer.policy_update.PolicyUpdate`), and a token count that does not match is an error.
Under 1F1B pipelining a stage runs its micro-batches' forwards in order, so the order holds with PP > 1; full
activation recomputation would run a router twice per micro-batch and is refused. R3 (``replay_rollout``) replays the
rollout engine's routing through the same routers: :mod:`dapo_megatron.policy.rollout_routing`.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from torch import Tensor


def moe_routers(model: torch.nn.Module) -> list[TopKRouter]:
    """This stage's routers in layer order (none for a dense model)."""
    return [module for module in model.modules() if isinstance(module, TopKRouter)]


class RouterLoadMonitor:
    """Per-layer expert load of the forward passes between :meth:`start` and :meth:`finish` (see the module
    docstring). ``num_layers``: the whole model's (a router knows its global layer number)."""

    def __init__(self, model: torch.nn.Module, *, num_layers: int, sequence_parallel: bool) -> None:
        self.routers = moe_routers(model)
        self.num_layers = num_layers
        self.sequence_parallel = sequence_parallel
        self.experts = self.routers[0].config.num_moe_experts if self.routers else 0
        self.topk = self.routers[0].topk if self.routers else 0
        # per local layer: [assignments per expert, Σ probability per expert, tokens], on the routers' device (made
        # at the first forward): nothing leaves the device until finish()
        self._sums: Tensor | None = None
        self._active = False
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def record(router: TopKRouter, args, output) -> None:
            if not self._active:
                return
            _, routing_map = output
            with torch.no_grad():
                hidden = args[0].reshape(-1, args[0].shape[-1])
                probs = torch.softmax(torch.nn.functional.linear(hidden.float(), router.weight.float()), dim=-1)
                if self._sums is None:
                    self._sums = torch.zeros(len(self.routers), 2 * self.experts + 1, dtype=torch.float64,
                                             device=routing_map.device)
                self._sums[index, :self.experts] += routing_map.sum(0)
                self._sums[index, self.experts:-1] += probs.sum(0)
                self._sums[index, -1] += hidden.shape[0]
        return record

    def start(self) -> None:
        if self._sums is not None:
            self._sums.zero_()
        self._active = True

    def finish(self, device: torch.device) -> dict[str, float]:
        """Every rank calls it (collectives); the same metrics on every rank, {} for a dense model."""
        self._active = False
        if not self.routers:
            return {}
        experts = self.experts
        every = torch.zeros(self.num_layers, 2 * experts + 1, dtype=torch.float64, device=device)
        if self._sums is not None:  # a rank without tokens this update (a filler micro-batch) adds zeros
            layers = [router.layer_number - 1 for router in self.routers]  # megatron numbers layers from 1
            every[layers] = self._sums.to(device)
        groups = [parallel_state.get_data_parallel_group()]
        if self.sequence_parallel:
            groups.append(parallel_state.get_tensor_model_parallel_group())
        groups.append(parallel_state.get_pipeline_model_parallel_group())  # other stages' layers are zeros here
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(every, group=group)
        every = every.cpu()
        tokens = every[:, -1].clamp(min=1)[:, None]
        share = every[:, :experts] / (tokens * self.topk)  # f_i
        mean_probability = every[:, experts:2 * experts] / tokens  # P_i
        aux = experts * (share * mean_probability).sum(-1)
        imbalance = share.max(-1).values * experts
        metrics = {"moe_aux_loss": float(aux.mean()), "moe_load_imbalance": float(imbalance.max())}
        metrics.update({f"moe_load_imbalance/layer_{layer:02d}": float(value) for layer, value in enumerate(imbalance)})
        return metrics


ROUTING_INDEX_BYTES = 2  # int16: expert indices < 32768


def host_copy(indices: Tensor) -> Tensor:
    """``indices`` as int16 in host memory, pinned when they come from the GPU (so the replay's copy back runs
    asynchronously). A step's recorded routing lives from π_old's pass to the last update: on the GPU that is
    ``layers · k · 2`` bytes a token (768 B for Qwen3-30B-A3B) for every token of the rank's share of the step."""
    host = indices.to(device="cpu", dtype=torch.int16)
    return host.pin_memory() if indices.is_cuda else host


def recorded_routing_bytes(*, tokens: int, layers: int, topk: int) -> int:
    """Host bytes of the routing one rank records for ``tokens`` tokens through ``layers`` MoE layers."""
    return tokens * layers * topk * ROUTING_INDEX_BYTES


@dataclass
class RecordedRouting:
    """The top-k indices every router of this stage chose in one pass: ``per_router[r][m]`` is router ``r``'s
    ``[tokens, k]`` for the pass's ``m``-th micro-batch, int16 in host memory (:func:`host_copy`)."""

    per_router: list[list[Tensor]] = field(default_factory=list)


class RoutingReplay:
    """Record a pass's routing and replay it in another (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        missing = [r for r in self.routers if r.router_replay is None]
        if missing or not self.routers:
            raise ValueError("routing replay needs a mixture-of-experts model built with moe_enable_routing_replay")
        if self.routers[0].config.recompute_granularity == "full":
            raise ValueError("routing replay cannot run with full activation recomputation: the recomputed forward "
                             "would consume the next micro-batch's routing")

    @contextmanager
    def recording(self) -> Iterator[RecordedRouting]:
        """The routing of every forward in the block, per router and micro-batch."""
        recorded = RecordedRouting([[] for _ in self.routers])

        def keep(index: int):
            def hook(router: TopKRouter, args, output) -> None:
                recorded.per_router[index].append(host_copy(router.router_replay.get_recorded_indices()))
            return hook

        with self._action(RouterReplayAction.RECORD, [r.register_forward_hook(keep(i))
                                                       for i, r in enumerate(self.routers)]):
            yield recorded

    @contextmanager
    def replaying(self, recorded: RecordedRouting) -> Iterator[None]:
        """The forwards in the block route with ``recorded``'s indices, micro-batch by micro-batch; every recorded
        micro-batch must be used."""
        if len(recorded.per_router) != len(self.routers):
            raise ValueError(f"recorded routing of {len(recorded.per_router)} routers for {len(self.routers)}")
        queues = [deque(indices) for indices in recorded.per_router]

        def target(index: int):
            def hook(router: TopKRouter, args) -> None:
                tokens = args[0].numel() // args[0].shape[-1]
                if not queues[index]:
                    raise RuntimeError(f"routing replay: router {index} ran more forwards than were recorded")
                indices = queues[index].popleft()
                if indices.shape[0] != tokens:
                    raise RuntimeError(f"routing replay: router {index} routes {tokens} tokens, the recorded pass "
                                       f"routed {indices.shape[0]} in this micro-batch (different batching)")
                router.router_replay.set_target_indices(indices.to(device=args[0].device, dtype=torch.long))
            return hook

        with self._action(RouterReplayAction.REPLAY_FORWARD, [r.register_forward_pre_hook(target(i))
                                                               for i, r in enumerate(self.routers)]):
            yield
        left = [len(queue) for queue in queues if queue]
        if left:
            raise RuntimeError(f"routing replay: {left[0]} recorded micro-batches were not replayed")

    @contextmanager
    def _action(self, action: RouterReplayAction, hooks: list) -> Iterator[None]:
        for router in self.routers:
            router.router_replay.set_router_replay_action(action)
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for router in self.routers:
                router.router_replay.clear_router_replay_action()
                router.router_replay.clear_indices()
