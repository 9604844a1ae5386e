"""LoRA adapters on megatron's tensor-parallel linears, the base frozen (``model.lora``,
:class:`dapo_megatron.config.model.LoRAConfig`).

megatron-core 0.16.1 has no LoRA module (and Megatron-Bridge's needs transformers < 5 and Transformer Engine), so
:func:`add_adapters` puts one :class:`LoRAAdapter` next to every targeted linear of a built ``GPTModel`` stage: the
local spec's and the CPU spec's ``ColumnParallelLinear`` / ``RowParallelLinear``, Transformer Engine's column, row
and fused norm + column linears, and the linears of a mixture-of-experts layer's experts (megatron's
``SequentialMLP``). The adapter is a sibling module named ``<linear>_lora`` (``self_attention.linear_qkv_lora``) with
parameters ``lora_a`` ``[rank, in]`` and ``lora_b`` ``[out, rank]``, added to the linear's output by a forward hook
on it: the base's parameters keep their names (the HF mapping, the loader, the handoff and checkpoints read them
unchanged) and its ``sharded_state_dict`` stays megatron's own.

What each adapter computes, with ``s = alpha / rank`` and the layouts everyone uses (Megatron-Bridge, ROLL):

* column-parallel base (``linear_qkv``, ``linear_fc1``; output split over TP): ``A`` replicated, ``B`` split on the
  output dimension like the base. ``h = A x`` on every rank, then ``y_r += s · B_r h``. ``h`` passes through
  megatron's copy-to-TP region (identity forward, all-reduce backward) so ``A``'s gradient and the input's are the
  sums over the ranks' ``B_r``; under sequence parallelism ``h`` (``[s/T, b, r]``) is all-gathered instead
  (reduce-scattered backward) and ``A``'s gradient, partial over the rank's tokens, is summed over TP by megatron's
  ``finalize_model_grads`` (the ``sequence_parallel`` mark, as for norms).
* row-parallel base (``linear_proj``, ``linear_fc2``; input split over TP): ``A`` split on the input dimension like
  the base, ``B`` replicated. ``h = Σ_r A_r x_r`` by an all-reduce of the ``[s, b, rank]`` partial products (a
  reduce-scatter under sequence parallelism, ``B`` then marked like ``A`` above), then ``y += s · B h``.
* an expert's linear: its own tokens, no collective (experts are split over EP ranks, not TP: :func:`add_adapters`
  refuses an expert tensor-parallel layout).
* Transformer Engine's fused norm + column linear: the hook sees the un-normalized input, so the adapter applies the
  same RMSNorm (the linear's ``layer_norm_weight``, the config's eps) to its own copy first.

Dropout (``model.lora.dropout``, training forwards only) uses megatron's model-parallel RNG where the adapter's input
differs between TP ranks (a row-parallel input, a sequence-parallel one) and the default generator where it is the
same tensor on every rank (so all ranks drop the same elements).

Initialization is independent of the parallel layout: every adapter draws its full ``A`` from a generator seeded by
the run seed and the adapter's global name (:func:`adapter_key`: the layer's global number, the expert's global
index), then keeps its TP slice; ``B`` starts at zero, so the model starts as the base. TP 2 therefore trains the
same adapters as TP 1.

The base is frozen before megatron's DDP and optimizer are built (:func:`add_adapters` sets ``requires_grad`` False
on every other parameter), and both skip frozen parameters: no gradient buffer, no fp32 main copy, no Adam moments
(``bench/lora_memory.py`` measures the bytes). With bf16 parameters the adapters are bf16 in the model and fp32 in the
optimizer's main copy, as every parameter is under megatron's mixed precision.
"""

from __future__ import annotations

import math
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from torch import Tensor

from dapo_megatron.policy.lora.names import adapter_module_name

if TYPE_CHECKING:
    from dapo_megatron.config.model import LoRAConfig

ParallelMode = Literal["column", "row"]


class LoRALayoutError(ValueError):
    """LoRA cannot be put on this model at this layout (a linear kind or an expert split it does not support)."""


def parallel_mode(linear: torch.nn.Module) -> ParallelMode | None:
    """"column" or "row" for the linears an adapter can wrap, None for any other module. Transformer Engine's
    grouped-GEMM experts are refused (their weights are one per expert inside one module)."""
    if isinstance(linear, ColumnParallelLinear):
        return "column"
    if isinstance(linear, RowParallelLinear):
        return "row"
    # before the parallel mode: with expert parallelism or TP megatron builds the grouped experts with
    # parallel_mode None (it communicates for them itself), which would read as "no linear" and leave them bare
    if hasattr(linear, "num_gemms"):
        raise LoRALayoutError(
            f"{type(linear).__name__}: LoRA on Transformer Engine's grouped-GEMM experts is not implemented; use "
            f"model.kernels: local (megatron's SequentialMLP experts take adapters), or leave linear_fc1 and "
            f"linear_fc2 out of model.lora.target_modules")
    mode = getattr(linear, "parallel_mode", None)  # Transformer Engine's linears (megatron's TE extension)
    if mode is None:
        return None
    if mode not in ("column", "row"):
        raise LoRALayoutError(f"{type(linear).__name__}: parallel_mode {mode!r} (duplicated) takes no adapter")
    return mode


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def adapter_key(global_layer: int, path: str) -> str:
    """The adapter's name whatever the layout: its global layer and its path in the layer, an expert by its global
    index (``3/mlp.experts.local_experts.5/linear_fc1`` reads: layer 3, expert 5)."""
    return f"{global_layer}/{path}"


def kaiming_uniform_a(rank: int, fan_in: int, *, seed: int, key: str) -> Tensor:
    """``A`` ``[rank, fan_in]`` as PEFT initializes it (``kaiming_uniform_(a=sqrt(5))``: uniform in
    ``±1/sqrt(fan_in)``), float32, from a generator seeded by ``seed`` and ``key`` alone."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(rank, fan_in).uniform_(-bound, bound, generator=generator)


@dataclass(frozen=True)
class AdapterPlacement:
    """Where one adapter sits: its base linear's parallel layout and its input."""

    mode: ParallelMode
    in_features: int  # of this rank's shard of the base weight
    out_features: int
    tensor_parallel: int
    tp_rank: int
    sequence_parallel: bool
    expert: bool
    gated: bool  # the base is a SwiGLU fc1: each rank's rows are its gate half, then its up half
    norm_eps: float | None  # Transformer Engine's fused norm + linear: RMSNorm the input first (None: no norm)


class LoRAAdapter(torch.nn.Module):
    """``s · B A x`` for one base linear, added to its output by a forward hook (see the module docstring)."""

    def __init__(self, linear: torch.nn.Module, placement: AdapterPlacement, settings: "LoRAConfig", *, seed: int,
                 key: str) -> None:
        super().__init__()
        p = placement
        self.placement = placement
        self.key = key
        self.scale = settings.scale
        self.dropout = settings.dropout
        self.tp_group = linear.tp_group
        weight = linear.weight
        full_in = p.in_features * (p.tensor_parallel if p.mode == "row" else 1)
        a = kaiming_uniform_a(settings.rank, full_in, seed=seed, key=key)
        if p.mode == "row":
            a = a[:, p.tp_rank * p.in_features:(p.tp_rank + 1) * p.in_features]
        self.lora_a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
        self.lora_b = torch.nn.Parameter(torch.zeros(p.out_features, settings.rank, device=weight.device,
                                                     dtype=weight.dtype))
        split = self.lora_b if p.mode == "column" else self.lora_a
        set_tensor_model_parallel_attributes(split, True, 0 if p.mode == "column" else 1, 1)
        if p.sequence_parallel:  # gradient partial over this rank's tokens: summed over TP by finalize_model_grads
            (self.lora_a if p.mode == "column" else self.lora_b).sequence_parallel = True
        for parameter in (self.lora_a, self.lora_b):
            parameter.allreduce = getattr(weight, "allreduce", True)  # False for experts: megatron's expert DP
        self._norm_weight = getattr(linear, "layer_norm_weight", None) if p.norm_eps is not None else None
        self._base_weight = [weight]  # in a list: an attribute would register the base's weight as the adapter's
        self._hook = linear.register_forward_hook(self._add_to_output)

    @property
    def base_weight(self) -> torch.nn.Parameter:
        """The frozen weight of the linear this adapter is added to (this rank's shard)."""
        return self._base_weight[0]

    def extra_repr(self) -> str:
        p = self.placement
        return (f"{self.key}: {p.mode}, rank {self.lora_a.shape[0]}, in {p.in_features}, out {p.out_features}, "
                f"scale {self.scale:g}")

    # -- forward -----------------------------------------------------------------------------------------------

    def _add_to_output(self, module, args, output):
        out, bias = output
        # called as a module, not through delta(): megatron's DDP waits for this module's overlapped parameter
        # all-gather in a forward pre-hook (parallel.overlap_param_gather), which a direct call would skip
        return out + self(args[0]).to(out.dtype), bias

    def forward(self, x: Tensor) -> Tensor:
        return self.delta(x)

    def _input(self, x: Tensor) -> Tensor:
        if self._norm_weight is not None:
            exact = x.float()  # one float32 copy, which backward keeps for both the square and the product
            normalized = exact * torch.rsqrt(exact.pow(2).mean(-1, keepdim=True) + self.placement.norm_eps)
            x = normalized.to(x.dtype) * self._norm_weight
        if self.dropout and self.training:
            p = self.placement
            # the same tensor on every TP rank: the default generator (the same draws everywhere); a rank's own
            # shard (row-parallel input, sequence-parallel tokens): megatron's model-parallel RNG
            same_on_all_ranks = p.mode == "column" and not p.sequence_parallel and not p.expert
            with nullcontext() if same_on_all_ranks else tensor_parallel.get_cuda_rng_tracker().fork():
                x = F.dropout(x, self.dropout, training=True)
        return x

    def delta(self, x: Tensor) -> Tensor:
        """The adapter's addition to the base linear's output for the base's input ``x``."""
        p = self.placement
        h = F.linear(self._input(x), self.lora_a)
        if not p.expert and p.tensor_parallel > 1:
            if p.mode == "column":
                h = (gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
                     if p.sequence_parallel else copy_to_tensor_model_parallel_region(h, group=self.tp_group))
            else:
                h = (reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) if p.sequence_parallel
                     else reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        return F.linear(h, self.lora_b) * self.scale

    @torch.no_grad()
    def merge_into_base(self) -> None:
        """``W += s · B A`` on this rank's shard (column: its rows of B; row: its columns of A: a local product),
        then stop adding to the linear's output. For exports: the model then holds merged weights, not the base."""
        weight = self.base_weight
        weight.add_((self.lora_b.float() @ self.lora_a.float() * self.scale).to(weight.dtype))
        self._hook.remove()

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """``B`` split on dim 0 (column) or ``A`` on dim 1 (row) over TP, like the base's weight; a SwiGLU fc1's
        ``B`` through megatron's SwiGLU factory (each rank holds its gate rows, then its up rows), so a checkpoint
        loads at another TP size like the base's does."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axis = {"lora_b": 0} if self.placement.mode == "column" else {"lora_a": 1}
        sharded = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axis,
                                                      sharded_offsets, tp_group=self.tp_group,
                                                      dp_cp_group=metadata["dp_cp_group"])
        if self.placement.gated:
            key = f"{prefix}lora_b"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets,
                                                        metadata.get("singleton_local_shards", False))
        return sharded


def _placement(linear: torch.nn.Module, mode: ParallelMode, *, name: str, expert: bool, gated: bool,
               config) -> AdapterPlacement:
    out_features, in_features = linear.weight.shape
    tensor_parallel = _group_size(linear.tp_group)
    if expert and tensor_parallel > 1:
        raise LoRALayoutError(f"{name}: LoRA on experts split by expert tensor parallelism ({tensor_parallel} ranks) "
                              f"is not supported; split the experts with parallel.expert instead")
    fused_norm = hasattr(linear, "layer_norm_weight")
    if fused_norm and getattr(linear, "normalization", "RMSNorm") != "RMSNorm":
        raise LoRALayoutError(f"{name}: the fused norm is {linear.normalization}, the adapter re-applies RMSNorm only")
    return AdapterPlacement(
        mode=mode, in_features=in_features, out_features=out_features, tensor_parallel=tensor_parallel,
        tp_rank=_group_rank(linear.tp_group), sequence_parallel=bool(getattr(linear, "sequence_parallel", False))
        and not expert, expert=expert, gated=gated, norm_eps=config.layernorm_epsilon if fused_norm else None)


def _global_path(path: str, local_experts: int) -> str:
    """``mlp.experts.local_experts.1.linear_fc1`` with the expert's local index made global (its EP rank's
    experts come after the ranks before it)."""
    parts = path.split(".")
    if "local_experts" in parts:
        where = parts.index("local_experts") + 1
        parts[where] = str(parallel_state.get_expert_model_parallel_rank() * local_experts + int(parts[where]))
    return ".".join(parts)


def add_adapters(model: torch.nn.Module, settings: "LoRAConfig", *, seed: int) -> list[LoRAAdapter]:
    """Freeze every parameter of the (unwrapped) ``GPTModel`` stage ``model``, then put a :class:`LoRAAdapter` on
    each linear named in ``settings.target_modules`` in each of its layers. Call it before megatron's DDP wrapper
    and optimizer are built (they take only what requires a gradient). Returns the adapters in model order."""
    model.requires_grad_(False)
    adapters = []
    for layer in model.decoder.layers:
        experts = getattr(getattr(layer.mlp, "experts", None), "local_experts", None)
        for path, linear in list(layer.named_modules()):
            parent_path, _, name = path.rpartition(".")
            if name not in settings.target_modules:
                continue
            mode = parallel_mode(linear)
            if mode is None:
                continue
            expert = ".experts." in f".{path}"
            gated = name == "linear_fc1" and bool(model.config.gated_linear_unit)
            placement = _placement(linear, mode, name=path, expert=expert, gated=gated, config=model.config)
            adapter = LoRAAdapter(linear, placement, settings, seed=seed,
                                  key=adapter_key(layer.layer_number - 1, _global_path(path, len(experts or ()))))
            layer.get_submodule(parent_path).add_module(adapter_module_name(name), adapter)
            adapters.append(adapter)
    if not adapters:
        raise LoRALayoutError(f"model.lora.target_modules {settings.target_modules} matched no linear of this stage")
    return adapters


def merge_adapters(model: torch.nn.Module) -> int:
    """Merge every adapter of the stage into its base linear (:meth:`LoRAAdapter.merge_into_base`) and remove it;
    returns how many. The model then computes what it computed with the adapters, as plain weights."""
    merged = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRAAdapter):
                child.merge_into_base()
                delattr(parent, name)
                merged += 1
    return merged

