"""The DAPO step on the policy: megatron-core's pipeline schedule running the DAPO loss, and forward-only log-probs.

:func:`build_actor` builds this rank's ``GPTModel`` stage (``policy/model.py``) with the platform's backend
(:mod:`dapo_megatron.backend`: layer spec, packed-row layout) and its DDP wrapper, optimizer and LR schedule
(``policy/optimizer.py``) from the run config's sections. :class:`Actor` then runs, through megatron-core's
pipeline schedule (``get_forward_backward_func``), either

* :meth:`Actor.train_minibatch` — one optimizer update on a mini-batch with the loss it is given (a
  :class:`dapo_megatron.algorithm.PolicyLoss` with its settings bound; the trainer's comes from the ``algorithm``
  section through :func:`dapo_megatron.algorithm.build_policy_loss`), or
* :meth:`Actor.compute_logprobs` — the forward-only per-token log-probs (and entropy) of the responses.

Both take the WHOLE mini-batch, the same list on every rank; :func:`dapo_megatron.policy.batch_plan.plan_data_parallel`
gives each DP rank its share as packed micro-batches, with the same micro-batch count on every DP rank.

Making the objective exactly ``L = Σ_{mini-batch} m·ℓ / N`` (token-mean; N = loss tokens of the whole mini-batch,
over micro-batches and DP ranks), with megatron-core 0.16.1's conventions, checked in its source:

* ``calculate_per_token_loss`` stays False, so a ``(loss, metrics)`` pair returned by the loss function is divided
  by ``num_microbatches`` in ``forward_step_calc_loss`` before backward;
* ``DistributedDataParallel`` then averages gradients over DP (``average_in_collective=False``: it pre-scales by
  ``1 / dp`` and sums; ``True``: it averages in the collective — the same ``1 / dp`` either way);
* so each micro-batch returns ``loss(..., num_tokens=N) · num_microbatches · dp``, where
  ``loss(..., num_tokens=N) = Σ_{micro-batch} m·ℓ / N``. The gradient summed over micro-batches and averaged
  over DP is then ``∇ Σ_{micro-batches, ranks} Σ m·ℓ / N = ∇L``. (The seq-mean aggregations use the global count
  of sequences the same way.) N needs no communication: every rank holds the whole mini-batch.

The gradient norm is computed once per update (``prepare_grads`` + ``get_grad_norm``): it decides the skip below and
is the norm :func:`dapo_megatron.overrides.megatron_core.optimizer_step.clip_and_step` clips by. A step whose loss or
gradient norm is not finite is skipped: no optimizer update, no scheduler advance, gradients zeroed, and ``skipped=1``
in the metrics.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor

from dapo_megatron.algorithm.loss import TOKEN_MEAN_METRICS
from dapo_megatron.overrides.megatron_core.optimizer_step import clip_and_step
from dapo_megatron.policy.batch_plan import PackedBatching, plan_data_parallel
from dapo_megatron.policy.logprobs import vocab_parallel_logprobs
from dapo_megatron.policy.lora.adapter import add_adapters
from dapo_megatron.policy.model import (
    build_model,
    config_row_multiple,
    require_sequence_parallel_for_moe_training,
    sequence_parallel_enabled,
    transformer_config,
)
from dapo_megatron.policy.moe_routing import RecordedRouting, RouterLoadMonitor, RoutingReplay
from dapo_megatron.policy.optimizer import sync_params, wrap_for_training
from dapo_megatron.policy.packing import MicroBatch, PolicySample
from dapo_megatron.policy.rollout_routing import RoutingAgreement, replaying_on_stage

if TYPE_CHECKING:
    from dapo_megatron.backend.base import Backend
    from dapo_megatron.algorithm import PolicyLoss
    from dapo_megatron.config import ModelConfig, OptimConfig, ParallelConfig
    from dapo_megatron.policy.model_spec import ModelSpec

METRIC_NAMES = TOKEN_MEAN_METRICS  # every loss's token means, combined over micro-batches by their token counts


@dataclass
class PolicyLogProbs:
    """Per-sample response log-probs and entropies (float32 ``[R_i]``, CPU), in the order the samples were given;
    with ``record_routing``, the experts this stage's routers chose (:mod:`dapo_megatron.policy.moe_routing`)."""

    logprobs: list[Tensor]
    entropy: list[Tensor]
    routing: RecordedRouting | None = None
    routing_agreement: RoutingAgreement | None = None  # replaying the engine's routing: the routers' own choices


def aligned_batching(batching: PackedBatching, multiple: int) -> PackedBatching:
    """``batching`` with every row — filler micro-batches too — padded to a multiple of ``multiple`` as well
    (:func:`dapo_megatron.policy.model.row_multiple`: TP under sequence parallelism, 16 or 32 for FP8 GEMMs)."""
    if batching.pad_to_multiple % multiple == 0:
        return batching
    return replace(batching, pad_to_multiple=math.lcm(batching.pad_to_multiple, multiple))


def build_actor(spec: "ModelSpec", *, backend: "Backend", model: "ModelConfig", parallel: "ParallelConfig",
                optim: "OptimConfig", routing_replay: bool, micro_batch_tokens: int, temperature: float,
                seed: int = 0) -> "Actor":
    """This rank's model stage for ``spec`` at the initialized TP/PP layout on ``backend``, ready to train.

    ``model.precision`` picks the parameter dtype and ``model.recompute`` the activation recomputation (as the
    backend allows); ``parallel`` the sequence parallelism (where megatron supports it), the optimizer and the
    communication overlap; ``optim`` its settings; ``routing_replay`` builds a mixture-of-experts model whose
    routers can replay recorded choices (``algorithm.moe_routing_replay``: R2 or R3); micro-batches are packed to
    ``micro_batch_tokens`` tokens and log-probs taken at the rollout ``temperature``. ``model.lora.enabled``: the
    base is frozen and adapters drawn from ``seed`` are all that trains (:mod:`dapo_megatron.policy.lora.adapter`).
    """
    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
    sequence_parallel = sequence_parallel_enabled(parallel.sequence_parallel, tensor_parallel=tensor_parallel,
                                                  use_transformer_engine=backend.uses_transformer_engine)
    require_sequence_parallel_for_moe_training(has_experts=spec.moe is not None, tensor_parallel=tensor_parallel,
                                               sequence_parallel=sequence_parallel,
                                               use_transformer_engine=backend.uses_transformer_engine)
    tconfig = transformer_config(
        spec, backend,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=parallel_state.get_pipeline_model_parallel_world_size(),
        precision=model.precision,
        sequence_parallel=sequence_parallel,
        recompute=backend.recompute(model.recompute),
        expert_parallel=parallel_state.get_expert_model_parallel_world_size(),
        moe_aux_loss_coeff=model.moe.aux_loss_coeff,
        moe_routing_replay=routing_replay,
    )
    stage = build_model(spec, tconfig, backend)
    if model.lora.enabled:
        add_adapters(stage, model.lora, seed=seed)
        # only the adapters train; megatron's param groups would decay each (2-D) one by optim.weight_decay
        optim = replace(optim, weight_decay=model.lora.weight_decay)
    ddp_model, optimizer, scheduler = wrap_for_training(
        stage, optim, use_distributed_optimizer=parallel.use_distributed_optimizer,
        overlap_grad_reduce=parallel.overlap_grad_reduce, overlap_param_gather=parallel.overlap_param_gather,
        lr_multiplier=model.lora.lr_multiplier if model.lora.enabled else 1.0)
    return Actor(ddp_model, optimizer, scheduler, backend=backend, real_vocab_size=spec.vocab_size,
                 batching=PackedBatching(token_budget=micro_batch_tokens),
                 temperature=temperature)


class Actor:
    """One DDP-wrapped model stage with its optimizer and LR schedule (all reachable as attributes).

    ``backend``: the platform's (its row packer lays out the micro-batches); ``batching``: the token budget of a
    micro-batch unless a call says otherwise; ``temperature``: log-probs are of ``log_softmax(logits / T)``. The loss
    comes with each update: the actor knows no objective.
    """

    def __init__(self, model, optimizer, scheduler, *, backend: "Backend", real_vocab_size: int,
                 batching: PackedBatching, temperature: float) -> None:
        tconfig = model.config
        if tconfig.fp16:
            raise ValueError("fp16 is not supported by the actor (its NaN guard assumes no loss scaler); use bf16")
        if tconfig.calculate_per_token_loss:
            raise ValueError("TransformerConfig.calculate_per_token_loss must be False: the actor scales each "
                             "micro-batch loss itself (see the module docstring)")
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            tconfig.variable_seq_lengths = True  # packed micro-batches differ in length: p2p sends shapes first
        self.model = model  # megatron DistributedDataParallel around this stage's GPTModel
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.real_vocab_size = real_vocab_size
        self.batching = batching
        self.temperature = temperature
        self.backend = backend
        self.forward_backward = get_forward_backward_func()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_last_rank = parallel_state.get_pipeline_model_parallel_last_rank()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        # mixture of experts: the routers' load per update, and π_old's routing replayed when the model allows it
        self.router_load = RouterLoadMonitor(model, num_layers=tconfig.num_layers,
                                             sequence_parallel=tconfig.sequence_parallel)
        self.routing_replay = RoutingReplay(model) if tconfig.moe_enable_routing_replay else None

    # ----------------------------------------------------------------------------------------------- helpers

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _batching(self, batching: PackedBatching | None) -> PackedBatching:
        """The batching to use, with rows aligned for this model (:func:`aligned_batching`)."""
        return aligned_batching(batching or self.batching, config_row_multiple(self.model.config))

    def plan(self, samples: Sequence[PolicySample], batching: PackedBatching | None):
        """This DP rank's packed micro-batches of the mini-batch ``samples``, on the model's device."""
        return self.on_device(self.host_plan(samples, batching))

    def host_plan(self, samples: Sequence[PolicySample], batching: PackedBatching | None):
        """:meth:`plan`'s micro-batches still on the host (what R3 lays the engine's routing out from)."""
        self._check_same_minibatch_on_dp_ranks(samples)
        with self.backend.host_compute():  # packing never names CUDA
            return plan_data_parallel(
                samples, self._batching(batching), self.backend.packer, data_parallel=self.dp_size,
                data_parallel_rank=self.dp_rank, vocab_size=self.real_vocab_size,
            )

    def on_device(self, plan):
        device = self.device
        return replace(plan, micro_batches=[mb.to(device) for mb in plan.micro_batches])

    def _check_same_minibatch_on_dp_ranks(self, samples: Sequence[PolicySample]) -> None:
        """Every DP rank must be handed the same mini-batch (each takes its own share of it)."""
        if self.dp_size == 1:
            return
        local = torch.tensor([len(samples), sum(s.length for s in samples)], dtype=torch.float64)
        both = torch.cat([local, -local]).to(self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.dp_group)
        if not torch.equal(both[:2], -both[2:]):
            raise ValueError(
                f"DP ranks were given different mini-batches (samples/tokens here: {local.tolist()}, max over ranks: "
                f"{both[:2].tolist()}): pass the whole mini-batch, the same on every rank"
            )

    def _run_schedule(self, micro_batches: list[MicroBatch], loss_func, *, forward_only: bool) -> list:
        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output = model(mb.tokens, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params)
            return output, partial(loss_func, mb)

        return self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.sequence_length for mb in micro_batches),
            micro_batch_size=max(mb.tokens.shape[0] for mb in micro_batches),
            forward_only=forward_only,
        )

    def response_logprobs(self, mb: MicroBatch, logits: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
        """``[n, R]`` log-probs and entropies of the response tokens (0 past a response's end). The softmax runs at
        the response positions only, reading them from the logits in place: gathering ``[n, R]`` positions would copy
        the logits of every padded one too (one 20k-token response among short ones: several rows' worth, and its
        gradient as much again)."""
        valid = mb.response_valid
        logprobs, entropy = vocab_parallel_logprobs(
            logits.reshape(-1, logits.shape[-1]), mb.response_ids[valid], rows=mb.response_index[valid],
            real_vocab_size=self.real_vocab_size, temperature=temperature)
        return (logprobs.new_zeros(valid.shape).index_put((valid,), logprobs),
                entropy.new_zeros(valid.shape).index_put((valid,), entropy))

    def _share_from_last_stage(self, values: Tensor, *, sum_over_dp: bool) -> Tensor:
        """Sum over DP (last-stage ranks hold the values; others hold zeros), then broadcast from the last PP stage."""
        if sum_over_dp and self.dp_size > 1:
            dist.all_reduce(values, group=self.dp_group)
        if dist.get_world_size(self.pp_group) > 1:
            dist.broadcast(values, src=self.pp_last_rank, group=self.pp_group)
        return values

    # ------------------------------------------------------------------------------------------------ training

    def _training_loss(self, mb: MicroBatch, logits: Tensor, *, loss_fn: "PolicyLoss", scale: float, num_tokens: int,
                       num_sequences: int, reuse: Sequence[bool] | None = None):
        logprobs, entropy = self.response_logprobs(mb, logits, self.temperature)
        old_logprobs = mb.old_logprobs
        if reuse is not None:  # π_old = this forward's log-probs, detached, for the samples flagged
            rows = torch.tensor([reuse[i] for i in mb.sample_indices], dtype=torch.bool, device=logits.device)
            old_logprobs = torch.where(rows[:, None], logprobs.detach(), old_logprobs)
        loss, metrics = loss_fn(logprobs, old_logprobs, mb.advantages, mb.loss_mask, num_tokens=num_tokens,
                                num_sequences=num_sequences)
        metrics["entropy_sum"] = float((entropy * mb.loss_mask).sum())
        if reuse is not None:
            metrics.update(mb=mb, logprobs=logprobs.detach(), entropy=entropy)
        return loss * scale, metrics

    def train_minibatch(self, samples: Sequence[PolicySample], loss: "PolicyLoss",
                        batching: PackedBatching | None = None,
                        routing: RecordedRouting | None = None) -> dict[str, float]:
        """One optimizer update on the mini-batch ``samples`` (the whole mini-batch, the same on every rank) with the
        policy loss ``loss`` (:class:`dapo_megatron.algorithm.PolicyLoss`: its settings bound, its aggregation
        normalized by the mini-batch's loss tokens and sequences).

        ``batching`` overrides the actor's batching for this call. ``routing``: a mixture-of-experts policy's
        routers take the experts recorded by ``compute_logprobs(..., record_routing=True)`` of this same mini-batch
        and batching (:mod:`dapo_megatron.policy.moe_routing`) instead of choosing their own.

        Returns the same metrics on every rank: ``pg_loss`` (the mini-batch loss L), the token-weighted means
        ``clipfrac_high``, ``clipfrac_low``, ``clipfrac_dual``, ``approx_kl``, ``ratio_mean``, ``entropy``,
        then ``grad_norm`` (before clipping), ``lr`` (used by this update), ``num_tokens`` (loss tokens),
        ``num_sequences``, ``num_micro_batches`` (per DP rank), ``packing_efficiency`` (whole mini-batch) and
        ``skipped`` (1.0 when the loss or gradient norm was not finite and no update was applied); a MoE policy's
        routing statistics ``moe_aux_loss``, ``moe_load_imbalance`` and ``moe_load_imbalance/layer_NN``.
        """
        return self._train(samples, loss, batching, reuse=None, routing=routing)[0]

    def train_minibatch_reusing_logprobs(
            self, samples: Sequence[PolicySample], reuse: Sequence[bool], loss: "PolicyLoss",
            batching: PackedBatching | None = None) -> tuple[dict[str, float], PolicyLogProbs]:
        """:meth:`train_minibatch` where sample ``i`` with ``reuse[i]`` takes π_old's log-probs from this update's
        own forward pass, detached (its ``old_logprobs`` are ignored): exact when the policy still holds the
        weights π_old stands for, and then its importance ratio is exactly 1. Returns the update's metrics and the
        forward's (pre-update) log-probs and entropies of every sample, on every rank, in input order."""
        if len(reuse) != len(samples):
            raise ValueError(f"train_minibatch_reusing_logprobs: {len(reuse)} reuse flags for {len(samples)} samples")
        metrics, outputs = self._train(samples, loss, batching, reuse=list(reuse))
        return metrics, self._per_sample(samples, outputs)

    def _train(self, samples: Sequence[PolicySample], loss: "PolicyLoss", batching: PackedBatching | None,
               reuse: list[bool] | None, routing: RecordedRouting | None = None):
        if routing is not None and self.routing_replay is None:
            raise ValueError("routing to replay, but the model was built without routing replay")
        plan = self.plan(samples, batching)
        num_micro_batches = len(plan.micro_batches)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_func = partial(
            self._training_loss, loss_fn=loss, scale=float(num_micro_batches * self.dp_size),
            num_tokens=plan.num_loss_tokens, num_sequences=plan.num_loss_sequences, reuse=reuse,
        )
        self.router_load.start()
        with nullcontext() if routing is None else self.routing_replay.replaying(routing):
            per_micro_batch = self._run_schedule(plan.micro_batches, loss_func, forward_only=False)
        routing_metrics = self.router_load.finish(self.device)

        # [pg_loss, Σ n·metric for METRIC_NAMES, Σ n·entropy, n, real tokens, processed tokens]
        summary = torch.zeros(len(METRIC_NAMES) + 5, dtype=torch.float64)
        if self.is_last_stage:
            for metrics in per_micro_batch:
                weight = metrics["num_masked_tokens"]
                summary[0] += metrics["pg_loss"]
                for i, name in enumerate(METRIC_NAMES):
                    summary[1 + i] += metrics[name] * weight
                summary[len(METRIC_NAMES) + 1] += metrics["entropy_sum"]
                summary[len(METRIC_NAMES) + 2] += weight
            summary[-2] = sum(mb.num_real_tokens for mb in plan.micro_batches)
            summary[-1] = sum(mb.num_processed_tokens for mb in plan.micro_batches)
        summary = self._share_from_last_stage(summary.to(self.device), sum_over_dp=True).cpu()

        loss_value = float(summary[0])
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())  # the one norm of this update (clip_and_step reuses it)
        skipped = not (math.isfinite(loss_value) and math.isfinite(grad_norm))
        if skipped:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.scheduler.step(increment=1)
            applied = clip_and_step(self.optimizer, grad_norm)
            if not applied:
                raise RuntimeError("the Megatron optimizer reported an unsuccessful step without a loss scaler")

        tokens = max(float(summary[len(METRIC_NAMES) + 2]), 1.0)
        result = {"pg_loss": loss_value}
        for i, name in enumerate(METRIC_NAMES):
            result[name] = float(summary[1 + i]) / tokens
        result["entropy"] = float(summary[len(METRIC_NAMES) + 1]) / tokens
        result.update(
            grad_norm=grad_norm,
            lr=float(self.optimizer.param_groups[0]["lr"]),
            num_tokens=float(plan.num_loss_tokens),
            num_sequences=float(plan.num_loss_sequences),
            num_micro_batches=float(num_micro_batches),
            packing_efficiency=float(summary[-2] / max(float(summary[-1]), 1.0)),
            skipped=float(skipped),
            **routing_metrics,
        )
        return result, per_micro_batch

    # ---------------------------------------------------------------------------------------------- forward-only

    def _collect_logprobs(self, mb: MicroBatch, logits: Tensor, *, temperature: float):
        logprobs, entropy = self.response_logprobs(mb, logits, temperature)
        return torch.zeros((), device=logits.device), {"mb": mb, "logprobs": logprobs, "entropy": entropy}

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[PolicySample], temperature: float | None = None,
                         batching: PackedBatching | None = None, record_routing: bool = False,
                         engine_routing: Sequence[Tensor | None] | None = None) -> PolicyLogProbs:
        """Per-token log-probs (and entropy) of every sample's response, on every rank, in input order.

        ``temperature`` defaults to the actor's rollout temperature, ``batching`` to the actor's (a forward pass
        keeps no activations for backward, so it can afford a larger token budget). ``record_routing``: also
        return the experts this rank's routers chose (for :meth:`train_minibatch` of the same samples);
        ``engine_routing``: the engine's per-sample expert ids to replay instead (:mod:`.rollout_routing`).
        """
        temperature = self.temperature if temperature is None else temperature
        sync_params(self.model)  # with overlap_param_gather the last update's all-gather waits for a training forward
        host_plan = self.host_plan(samples, batching)
        if (record_routing or engine_routing is not None) and self.routing_replay is None:
            raise ValueError("record_routing needs a model built with routing replay (algorithm.moe_routing_replay)")
        replay = self.routing_replay.recording() if record_routing else nullcontext()
        if engine_routing is not None:  # laid out from the host micro-batches: no copy back from the GPU per row
            replay = replaying_on_stage(self.routing_replay, host_plan.micro_batches, samples, engine_routing,
                                        self.device)
        plan = self.on_device(host_plan)
        self.model.eval()
        try:
            with replay as recorded:
                collect = partial(self._collect_logprobs, temperature=temperature)
                outputs = self._run_schedule(plan.micro_batches, collect, forward_only=True)
        finally:
            self.model.train()
        routing, agreement = recorded if engine_routing is not None else (recorded, None)
        return replace(self._per_sample(samples, outputs), routing=routing, routing_agreement=agreement)

    def _per_sample(self, samples: Sequence[PolicySample], outputs: list[dict]) -> PolicyLogProbs:
        """The ``logprobs``/``entropy`` rows of the last stage's per-micro-batch outputs as per-sample tensors in
        input order, on every rank (each DP rank holds its share; the sum over DP and the broadcast from the last
        stage assemble the whole mini-batch)."""
        lengths = [sample.response_length for sample in samples]
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        flat = torch.zeros(2, offsets[-1], dtype=torch.float32, device=self.device)
        if self.is_last_stage:
            for output in outputs:
                mb = output["mb"]
                for row, index in enumerate(mb.sample_indices):
                    length = lengths[index]
                    flat[0, offsets[index]:offsets[index + 1]] = output["logprobs"][row, :length]
                    flat[1, offsets[index]:offsets[index + 1]] = output["entropy"][row, :length]
        flat = self._share_from_last_stage(flat, sum_over_dp=True).cpu()
        return PolicyLogProbs(
            logprobs=[flat[0, offsets[i]:offsets[i + 1]].clone() for i in range(len(samples))],
            entropy=[flat[1, offsets[i]:offsets[i + 1]].clone() for i in range(len(samples))],
        )
