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
Under 1F1B pipelining a stage runs its micro-batches' forwards in order, so the order holds with PP > 1.

Both replays go through one seam, :meth:`RoutingReplay.routed_by`: a function chooses each forward's experts, per
router and micro-batch. With activation recomputation (``model.recompute: full``) a router runs again in backward,
re-running its micro-batch's forward: that forward is recognized (it runs inside autograd's backward,
:func:`inside_backward`), consumes nothing, and routes with megatron's REPLAY_BACKWARD, which pops the target the
micro-batch's forward used (megatron queues each target in order; backward runs micro-batches in the order of their
forwards). Without recomputation that queue is not kept (:func:`dapo_megatron.overrides.megatron_core.router_replay.
set_replay_target`), so the GPU holds one micro-batch's targets per router, not the whole pass's. Targets reach the
GPU as int16, copied without blocking and widened there; the recorded indices leave it the same way, into pinned
host memory. R3 (``replay_rollout``) replays the rollout engine's routing through the seam:
:mod:`dapo_megatron.policy.rollout_routing`.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from torch import Tensor

from dapo_megatron.overrides.megatron_core.router_replay import set_replay_target


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
            if not self._active or inside_backward():  # a recomputed forward routes its tokens a second time
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
    """``indices`` as int16 in host memory: from the GPU narrowed there and copied without blocking into pinned memory
    (whatever later reads it on the GPU is ordered after the copy on the same stream). A step's recorded routing
    lives from π_old's pass to the last update: on the GPU that is ``layers · k · 2`` bytes a token (768 B for
    Qwen3-30B-A3B) for every token of the rank's share of the step."""
    if not indices.is_cuda:
        return indices.to(torch.int16, copy=True)
    narrow = indices.to(torch.int16)
    host = torch.empty(narrow.shape, dtype=torch.int16, pin_memory=True)
    host.copy_(narrow, non_blocking=True)
    return host


def on_device(indices: Tensor, device: torch.device) -> Tensor:
    """Host int16 indices as the int64 a router gathers with on ``device``: copied as int16 (without blocking from
    pinned memory), widened there."""
    return indices.to(device, non_blocking=True).long()


def recorded_routing_bytes(*, tokens: int, layers: int, topk: int) -> int:
    """Host bytes of the routing one rank records for ``tokens`` tokens through ``layers`` MoE layers."""
    return tokens * layers * topk * ROUTING_INDEX_BYTES


def inside_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread: a forward that runs then re-runs a
    checkpointed micro-batch (activation recomputation; torch's own checkpoint asks the same way)."""
    return torch._C._current_graph_task_id() != -1


def recomputes_routers(config) -> bool:
    """Whether a ``TransformerConfig``'s activation recomputation re-runs the routers in backward: full
    recomputation, or the selective ``moe`` module (the whole MoE layer)."""
    return config.recompute_granularity == "full" or (
        config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or ()))


@dataclass
class RecordedRouting:
    """The top-k indices every router of this stage chose in one pass: ``per_router[r][m]`` is router ``r``'s
    ``[tokens, k]`` for the pass's ``m``-th micro-batch, int16 in host memory (:func:`host_copy`)."""

    per_router: list[list[Tensor]] = field(default_factory=list)


class MicroBatchQueues:
    """Per router, one ``[tokens, k]`` entry per micro-batch, taken in the order the forwards run; ``what`` says where
    they came from ("recorded", "laid out"), ``hint`` what a token-count mismatch means."""

    def __init__(self, per_router: list[list[Tensor]], *, what: str, hint: str = "") -> None:
        self.queues = [deque(entries) for entries in per_router]
        self.what, self.hint = what, hint

    def take(self, index: int, tokens: int) -> Tensor:
        if not self.queues[index]:
            raise RuntimeError(f"routing replay: router {index} ran more forwards than were {self.what}")
        entry = self.queues[index].popleft()
        if entry.shape[0] != tokens:
            raise RuntimeError(f"routing replay: router {index} routes {tokens} tokens, the {self.what} micro-batch "
                               f"has {entry.shape[0]}{self.hint}")
        return entry

    def require_all_taken(self) -> None:
        left = [len(queue) for queue in self.queues if queue]
        if left:
            raise RuntimeError(f"routing replay: {left[0]} {self.what} micro-batches were not run")


ChooseExperts = Callable[[int, TopKRouter, Tensor], Tensor]
"""``(router index, router, hidden [T, H])`` → the ``[T, k]`` int64 expert ids it routes this forward with."""


class RoutingReplay:
    """Record a pass's routing and replay it in another (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        missing = [r for r in self.routers if r.router_replay is None]
        if missing or not self.routers:
            raise ValueError("routing replay needs a mixture-of-experts model built with moe_enable_routing_replay")
        self.recomputes = recomputes_routers(self.routers[0].config)

    @contextmanager
    def recording(self) -> Iterator[RecordedRouting]:
        """The routing of every forward in the block, per router and micro-batch."""
        recorded = RecordedRouting([[] for _ in self.routers])

        def keep(index: int):
            def hook(router: TopKRouter, args, output) -> None:
                if not inside_backward():  # a recomputed forward chose nothing new
                    recorded.per_router[index].append(host_copy(router.router_replay.get_recorded_indices()))
            return hook

        with self._action(RouterReplayAction.RECORD, [r.register_forward_hook(keep(i))
                                                       for i, r in enumerate(self.routers)]):
            yield recorded

    @contextmanager
    def routed_by(self, choose: ChooseExperts) -> Iterator[None]:
        """The forwards in the block route with ``choose``'s experts, called once per router and micro-batch
        forward; a recomputed forward routes as its micro-batch's forward did (megatron's REPLAY_BACKWARD) without
        calling it."""
        def target(index: int):
            def hook(router: TopKRouter, args) -> None:
                replay = router.router_replay
                if inside_backward():
                    replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                    return
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                experts = choose(index, router, args[0].reshape(-1, args[0].shape[-1]))
                set_replay_target(replay, experts, kept_for_recompute=self.recomputes)
            return hook

        with self._action(RouterReplayAction.REPLAY_FORWARD, [r.register_forward_pre_hook(target(i))
                                                               for i, r in enumerate(self.routers)]):
            yield

    @contextmanager
    def replaying(self, recorded: RecordedRouting) -> Iterator[None]:
        """The forwards in the block route with ``recorded``'s indices, micro-batch by micro-batch; every recorded
        micro-batch must be used."""
        if len(recorded.per_router) != len(self.routers):
            raise ValueError(f"recorded routing of {len(recorded.per_router)} routers for {len(self.routers)}")
        queues = MicroBatchQueues(recorded.per_router, what="recorded", hint=" (different batching)")

        def choose(index: int, router: TopKRouter, hidden: Tensor) -> Tensor:
            return on_device(queues.take(index, hidden.shape[0]), hidden.device)

        with self.routed_by(choose):
            yield
        queues.require_all_taken()

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
