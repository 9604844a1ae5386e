"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

With tensor parallelism the output layer leaves each TP rank holding logits ``x`` of shape ``[..., V_p / TP]`` for its
slice ``[start, start + V_p / TP)`` of the padded vocabulary ``V_p``. For one row, with the temperature-scaled logits
``z = x / T`` over the *real* vocabulary ``V`` (ids ``>= V`` are padding rows of the embedding, never tokens, and are
left out of every sum below):

    M        = max_v z_v                                         (all-reduce MAX of the per-rank maxima m_r)
    S        = Σ_v exp(z_v − M)    = Σ_r exp(m_r − M) · S_r,     S_r = Σ_{v∈r} exp(z_v − m_r)
    E        = Σ_v exp(z_v − M)(z_v − M)
             = Σ_r exp(m_r − M) · (E_r + (m_r − M) S_r),          E_r = Σ_{v∈r} exp(z_v − m_r)(z_v − m_r)
    log p_y  = (z_y − M) − log S                                  (z_y lives on exactly one rank; the others add 0)
    H        = −Σ_v p_v log p_v = log S − E / S

so a row costs one MAX and one SUM all-reduce of ``[rows, 3]`` numbers, whatever the vocabulary size. Each rank walks
its logits in row chunks, so the temporaries are ``chunk × V_p/TP`` rather than a float32 copy of the whole tensor.

Gradient (log-prob only; the entropy is a metric and is returned detached):

    ∂ log p_y / ∂ x_v = (1/T) · (1[v = y] − p_v)       for real-vocabulary v, 0 for padding rows.

The backward recomputes ``p`` chunk by chunk from the saved logits and the per-row ``M + log S`` (no softmax is kept
between forward and backward). Each rank's gradient only touches its own slice, so no collective is needed there.

Only some rows matter to the policy (a packed row's response positions, not its prompts or padding): ``rows`` picks
them from the logits in place, chunk by chunk. Nothing of ``[rows, V_p/TP]`` is gathered, so what the log-prob keeps
for backward is the logits tensor the model made anyway, and its gradient is that tensor's size whatever ``rows``
holds (a gathered copy was the size of the rows asked for — several times the logits when a micro-batch's response
rows were padded to its longest response).

Temperature follows the rollout engine (``dapo_megatron.rollout.sampling``): log-probs are taken of
``log_softmax(logits / T)``; ``T == 0`` (greedy) and ``T == 1`` mean no scaling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_CHUNK_ELEMENTS = 1 << 24  # logits elements per chunk: 64 MiB of float32 temporaries


def temperature_scale(temperature: float) -> float:
    """The factor ``1 / T`` applied to the logits; 1.0 for ``T`` in {0 (greedy), 1}. Negative ``T`` is an error."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature in (0.0, 1.0):
        return 1.0
    return 1.0 / float(temperature)


@dataclass(frozen=True)
class VocabShard:
    """This TP rank's slice ``[start, start + size)`` of the padded vocabulary, and how much of it is real."""

    start: int
    size: int
    real_vocab_size: int

    @property
    def real_columns(self) -> int:
        """Columns of this slice whose ids are real tokens (``< real_vocab_size``); the rest are padding rows."""
        return max(0, min(self.size, self.real_vocab_size - self.start))


def _chunk_rows(columns: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(1, columns))


class _VocabParallelLogProb(torch.autograd.Function):
    """Forward: (log p_y, H) per row from this rank's logits slice; backward: (1/T)(onehot − p) on the slice."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, picked: Tensor | None, shard: VocabShard, scale: float,
                group: dist.ProcessGroup | None, chunk_elements: int):
        rows = target.shape[0]
        real = shard.real_columns
        device = logits.device
        local_max = torch.full((rows,), float("-inf"), dtype=torch.float32, device=device)
        local_sums = torch.zeros(rows, 2, dtype=torch.float32, device=device)  # S_r, E_r (relative to m_r)
        target_shifted = torch.zeros(rows, dtype=torch.float32, device=device)  # z_y − m_r where this rank owns y
        local_target = target - shard.start
        owned = (local_target >= 0) & (local_target < real)
        step = _chunk_rows(real, chunk_elements)
        if real > 0:
            for begin in range(0, rows, step):
                end = min(rows, begin + step)
                z = _chunk(logits, picked, begin, end, real).float()
                if scale != 1.0:
                    z = z * scale
                chunk_max = z.max(dim=-1).values
                shifted = z - chunk_max[:, None]
                exp = shifted.exp()
                local_max[begin:end] = chunk_max
                local_sums[begin:end, 0] = exp.sum(dim=-1)
                local_sums[begin:end, 1] = (exp * shifted).sum(dim=-1)
                index = local_target[begin:end].clamp(0, real - 1)[:, None]
                target_shifted[begin:end] = shifted.gather(-1, index).squeeze(-1)
                del z, shifted, exp

        global_max = local_max.clone()
        if group is not None:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        # Rescale this rank's sums from m_r to M; a rank without real columns (m_r = −inf, S_r = 0) adds nothing.
        has_columns = local_sums[:, 0] > 0
        offset = torch.where(has_columns, local_max - global_max, 0.0)
        factor = torch.where(has_columns, offset.exp(), 0.0)
        totals = torch.stack(
            [
                factor * local_sums[:, 0],
                factor * (local_sums[:, 1] + offset * local_sums[:, 0]),
                torch.where(owned, target_shifted + offset, 0.0),
            ],
            dim=-1,
        )
        if group is not None:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
        log_sum = totals[:, 0].log()
        logprob = totals[:, 2] - log_sum
        entropy = log_sum - totals[:, 1] / totals[:, 0]

        ctx.save_for_backward(logits, picked, local_target, owned, global_max + log_sum)
        ctx.scale = scale
        ctx.real = real
        ctx.chunk_elements = chunk_elements
        ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob: Tensor, grad_entropy: Tensor):
        logits, picked, local_target, owned, log_normalizer = ctx.saved_tensors
        real, scale = ctx.real, ctx.scale
        grad_logits = torch.zeros_like(logits)
        if real == 0:
            return grad_logits, None, None, None, None, None, None
        rows = local_target.shape[0]
        step = _chunk_rows(real, ctx.chunk_elements)
        grad_logprob = grad_logprob.float()
        for begin in range(0, rows, step):
            end = min(rows, begin + step)
            z = _chunk(logits, picked, begin, end, real).float()
            if scale != 1.0:
                z = z * scale
            grad = (z - log_normalizer[begin:end, None]).exp().neg_()  # −p
            row_owned = owned[begin:end]
            index = local_target[begin:end].clamp(0, real - 1)[:, None]
            grad.scatter_add_(-1, index, row_owned.to(grad.dtype)[:, None])  # + onehot where this rank owns y
            grad.mul_((grad_logprob[begin:end] * scale)[:, None])
            if picked is None:
                grad_logits[begin:end, :real] = grad.to(grad_logits.dtype)
            else:  # accumulated: a row picked twice gets both gradients
                grad_logits[:, :real].index_add_(0, picked[begin:end], grad.to(grad_logits.dtype))
        return grad_logits, None, None, None, None, None, None


def _chunk(logits: Tensor, picked: Tensor | None, begin: int, end: int, real: int) -> Tensor:
    """Rows ``begin:end`` of the rows evaluated (all of ``logits``, or the ``picked`` ones), real columns only."""
    if picked is None:
        return logits[begin:end, :real]
    return logits[picked[begin:end], :real]


def vocab_parallel_logprobs(
    logits: Tensor,
    target_ids: Tensor,
    *,
    real_vocab_size: int,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    tp_rank: int | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-probabilities of ``target_ids`` and the entropy of every row, from this rank's vocab slice of ``logits``.

    Args:
        logits: ``[..., V_p / TP]`` this TP rank's slice of the padded vocabulary (any float dtype; math in float32);
            with ``rows``, ``[N, V_p / TP]``.
        target_ids: ``[...]`` global token ids, each ``< real_vocab_size`` (ids outside it give a meaningless value);
            with ``rows``, one per row picked.
        rows: the rows of ``logits`` to evaluate (``target_ids[i]`` is the token at row ``rows[i]``), read in place:
            no gathered copy is made or kept for backward, and the gradient flows to those rows of ``logits``.
        real_vocab_size: the tokenizer's vocabulary ``V``; logit columns with ids ``>= V`` are excluded.
        temperature: as the rollout engine applies it (see :func:`temperature_scale`).
        tp_group, tp_rank: the tensor-parallel group and this rank's index in it; default: megatron's
            ``parallel_state`` (a world of one when it is not initialized).
        chunk_elements: logits elements processed at a time (bounds the float32 temporaries).

    Returns:
        ``(logprobs, entropy)``, both float32 of shape ``[...]``; ``logprobs`` carries the gradient w.r.t. ``logits``,
        ``entropy`` is detached.
    """
    if rows is None and logits.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"vocab_parallel_logprobs: logits {tuple(logits.shape)} need target_ids of shape "
            f"{tuple(logits.shape[:-1])}, got {tuple(target_ids.shape)}"
        )
    if rows is not None and (logits.dim() != 2 or rows.shape != target_ids.shape):
        raise ValueError(
            f"vocab_parallel_logprobs: with rows, logits must be [N, V_p/TP] and rows as many as target_ids; got "
            f"logits {tuple(logits.shape)}, rows {tuple(rows.shape)}, target_ids {tuple(target_ids.shape)}"
        )
    if tp_group is None and tp_rank is None:
        tp_group, tp_rank = _megatron_tp_group()
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    if tp_rank is None:
        tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    shard_size = logits.shape[-1]
    if shard_size * tp_size < real_vocab_size:
        raise ValueError(
            f"vocab_parallel_logprobs: {tp_size} TP slices of {shard_size} logits cover {shard_size * tp_size} ids "
            f"< real_vocab_size {real_vocab_size}"
        )
    shard = VocabShard(start=tp_rank * shard_size, size=shard_size, real_vocab_size=real_vocab_size)
    group = tp_group if tp_size > 1 else None
    flat_logits = logits.reshape(-1, shard_size)
    flat_target = target_ids.reshape(-1).to(torch.long)
    picked = None if rows is None else rows.reshape(-1).to(torch.long)
    logprob, entropy = _VocabParallelLogProb.apply(
        flat_logits, flat_target, picked, shard, temperature_scale(temperature), group, chunk_elements
    )
    return logprob.view(target_ids.shape), entropy.view(target_ids.shape)


def _megatron_tp_group() -> tuple[dist.ProcessGroup | None, int]:
    # import cost: `dapo-megatron plan` reads this module's chunk size (policy/memory/gpu.py) without megatron-core
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, 0
    return (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank())
