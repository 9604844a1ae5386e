"""GPU memory of one training rank, stage by stage: :func:`estimate_memory` (and ``dapo-megatron plan CONFIG``).

The model, per GPU of pipeline stage ``p`` (``T`` = tensor-, ``P`` = pipeline-, ``D`` = data-parallel size; ``h``
hidden size, ``F`` FFN size, ``q``/``k`` = query/key-value width (heads × head_dim), ``a`` attention heads, ``V``
the vocabulary padded to a multiple of 128·T, ``t`` = ``trainer.micro_batch_tokens``, one packed row per
micro-batch, ``L`` layers of this stage):

**Parameters** — per layer ``(q + 2k)·h + q·h + 3·F·h`` (QKV, output projection, SwiGLU fc1 and fc2, all split
over T) plus the QKV bias ``(q + 2k)/T`` and the two norms ``2h`` (replicated); the embedding ``V·h/T`` on the first
stage, the output layer ``V·h/T`` and the final norm on the last (a tied output layer is a second copy there when
``P > 1``: megatron keeps the last stage's copy in sync by an all-reduce of its gradient).

**Mixture of experts** (Qwen3-MoE, ``E`` experts of width ``M``, top ``k``, split over ``X`` expert-parallel
ranks; :func:`moe_layer_parameters`, :func:`moe_activation_values_per_token`): a layer's MLP is the router ``E·h``
(replicated, float32 routing but stored in the weights' dtype) and this rank's ``E/X`` experts of ``3·M·h/T`` each;
expert parameters' optimizer state is divided by the expert-data-parallel size ``D/X`` (megatron's distributed
optimizer shards experts over their own DP group), not by D. Activations per token: each of its ``k`` dispatched
copies keeps the expert's input ``h``, SwiGLU's input ``2M/T`` and output ``M/T`` and the expert output ``h`` (scaled
by its routing probability in the combine) — counted at the average load of an EP rank (``k·t`` routed tokens); a
router that sends most tokens to one rank's experts can put several times this there.

**Bytes per parameter** — weights 2 (bf16 / fp8: Transformer Engine keeps bf16 parameters and casts per GEMM) or
4 (fp32); gradients 4 (``DistributedDataParallelConfig(grad_reduce_in_fp32=True)``, :mod:`..optimizer`); Adam's two
moments 8 plus an fp32 master copy 4 when the weights are not fp32, divided by D with the distributed optimizer
(megatron-core ``optimizer/distrib_optimizer.py``: each DP rank owns 1/D of the main parameters and state).

**Activations** kept for backward, per token per layer, in the activation dtype (2 bytes, 4 for fp32), derived as in
Korthikanti et al., *Reducing Activation Recomputation in Large Transformer Models* (2022, the paper megatron's
recomputation follows; ``TransformerConfig.recompute_granularity``) for this architecture — RMSNorm, SwiGLU, GQA, no
dropout (the project's configs set ``hidden_dropout = attention_dropout = 0``, so no dropout masks):

* the inputs and outputs of the two norms, ``4h`` — the sequence-parallel region: divided by T under sequence
  parallelism (megatron's linear layers then save their input un-gathered and all-gather it again in backward,
  ``tensor_parallel/layers.py``), not divided otherwise;
* the core attention's inputs ``(q + 2k)/T`` and its output (the output projection's input) ``q/T``;
* SwiGLU's input ``2F/T`` and output (fc2's input) ``F/T``;
* unfused attention only (megatron's local ``DotProductAttention``): the softmax probabilities of the whole packed
  row, ``a/T · t²`` per layer and micro-batch. Fused attention (Transformer Engine's flash / cuDNN kernels) keeps
  only per-row statistics, counted as nothing.

Recomputation: ``"selective"`` (megatron's ``core_attn``) drops the softmax term — the saved inputs of the
checkpointed attention are the q, k, v already counted; ``"full"`` keeps only each layer's input (``h``, divided by T
under sequence parallelism) and adds one layer's full set for the layer being recomputed.

Micro-batches in flight under 1F1B (megatron-core ``pipeline_parallel/schedules.py``,
``forward_backward_pipelining_without_interleaving``: stage ``p`` runs ``P − p − 1`` warm-up forwards before its
first backward): ``P − p``, so the first stage is the tightest. The last stage also keeps the final norm's and the
output layer's inputs (``2h``, SP-divided).

**Logits** (last stage, :func:`logprob_buffers`): the output layer's vocab-parallel logits of the micro-batch,
``t·V/T`` values kept for backward, plus their gradient of the same size, plus the log-prob's chunk temporaries
(``c = min(DEFAULT_CHUNK_ELEMENTS, t·V/T)`` values each: 4 in float32, and 2 in the activation dtype — the rows
read and the gradient cast back). :mod:`..logprobs` reads the response positions from the logits in place and
recomputes the softmax in chunks, so nothing else of vocabulary width lives
(``tests/integration/test_policy_actor.py`` checks what autograd saves). Not counted: the per-response-token loss
tensors, float32 ``[n, R]`` (n samples in the row, R its longest response; ~12 of them), tens of MB — e.g. one
20480-token response packed with 64 samples of 64 tokens is 65 × 20480 × 4 B × 12 ≈ 64 MB.

**Routing replay's targets** (``algorithm.moe_routing_replay``, :mod:`..moe_routing`): the expert ids each router
is replayed with, int64 ``[t/S, k]`` per MoE layer (``S`` = T under sequence parallelism), one micro-batch's on the
GPU at a time; with full recomputation every micro-batch in flight keeps its own until its recomputed forward
(megatron's REPLAY_BACKWARD queue). The host side (what replay keeps between passes): :mod:`.host`.

**Margin**: 3 GB for the CUDA context, NCCL's communicator buffers and library workspaces, plus 10 % of the
activations and logits for the caching allocator's fragmentation.

Not modelled: the forward-only log-prob passes (they keep nothing and run at other times), FP8 weight caches and
amax histories (Transformer Engine; small next to the above).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dapo_megatron.config import DAPOConfig
from dapo_megatron.config.model import Precision, Recompute
from dapo_megatron.policy.logprobs import DEFAULT_CHUNK_ELEMENTS
from dapo_megatron.policy.model import sequence_parallel_enabled
from dapo_megatron.policy.model_spec import ModelSpec, check_parallel_layout, padded_vocab_size

GB = 10**9
FIXED_MARGIN_BYTES = 3 * GB
FRAGMENTATION = 0.10
LOGPROB_CHUNK_TEMPORARIES = 4  # float32 chunk buffers live at once in the vocab-parallel log-prob
LOGPROB_CHUNK_COPIES = 2  # chunks in the activation dtype: the rows read, the gradient cast back
REPLAY_TARGET_BYTES = 8  # int64: the indices megatron's router gathers its scores with


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one GPU of pipeline stage ``stage`` (every GPU of a stage holds the same)."""

    stage: int
    layers: int
    parameters: int  # parameters held by this GPU
    micro_batches_in_flight: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    logits_bytes: int
    margin_bytes: int
    expert_parameters: int = 0  # of ``parameters``, a MoE model's experts (optimizer state sharded over DP / EP)
    frozen_parameters: int = 0  # of ``parameters``, those that never train (a LoRA run's base: policy/memory/lora.py)
    routing_bytes: int = 0  # routing replay's targets (int64) of the micro-batches that hold them

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.logits_bytes + self.margin_bytes + self.routing_bytes)

    def as_dict(self) -> dict[str, int]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total_bytes": self.total_bytes}


def layer_parameters(spec: ModelSpec, tensor_parallel: int) -> int:
    """Parameters of one transformer layer held by one TP rank, besides a MoE layer's experts
    (:func:`moe_layer_parameters`)."""
    q, k, h, f = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, \
        spec.ffn_hidden_size
    mlp = 3 * f * h if spec.moe is None else 0
    sharded = (q + 2 * k) * h + q * h + mlp + ((q + 2 * k) if spec.qkv_bias else 0)
    qk_norms = 2 * spec.head_dim if spec.qk_norm else 0
    router = spec.moe.num_experts * h if spec.moe is not None else 0
    return sharded // tensor_parallel + 2 * h + qk_norms + router


def moe_layer_parameters(spec: ModelSpec, tensor_parallel: int, expert_parallel: int) -> int:
    """Parameters of one MoE layer's experts held by one rank: its ``E / X`` experts, fc1 and fc2 split over TP."""
    if spec.moe is None:
        return 0
    per_expert = 3 * spec.moe.ffn_hidden_size * spec.hidden_size // tensor_parallel
    return spec.moe.num_experts // expert_parallel * per_expert


def activation_values_per_token(spec: ModelSpec, tensor_parallel: int, *, sequence_parallel: bool) -> float:
    """Values one layer keeps per token for backward without recomputation, excluding the attention softmax."""
    q, k, h, f = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, \
        spec.ffn_hidden_size
    sp = tensor_parallel if sequence_parallel else 1
    mlp = 3 * f / tensor_parallel if spec.moe is None else moe_activation_values_per_token(spec, tensor_parallel)
    return 4 * h / sp + (q + 2 * k + q) / tensor_parallel + mlp


def moe_activation_values_per_token(spec: ModelSpec, tensor_parallel: int) -> float:
    """What a MoE layer's experts keep per token at an EP rank's average load: ``k`` copies of (the expert's input,
    SwiGLU's input and output, the expert's output) — see the module docstring."""
    k, m, h = spec.moe.topk, spec.moe.ffn_hidden_size, spec.hidden_size
    return k * (2 * h + 3 * m / tensor_parallel)


def logprob_buffers(logit_values: int, act_bytes: int) -> dict[str, int]:
    """Bytes of the last stage's log-prob of a micro-batch whose logits hold ``logit_values`` values per GPU
    (``t·V/T``): the logits kept for backward, their gradient, the chunk temporaries (module docstring)."""
    chunk = min(DEFAULT_CHUNK_ELEMENTS, logit_values)
    return {"logits": logit_values * act_bytes, "gradient": logit_values * act_bytes,
            "temporaries": chunk * (LOGPROB_CHUNK_TEMPORARIES * 4 + LOGPROB_CHUNK_COPIES * act_bytes)}


def estimate_memory(
    spec: ModelSpec,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    data_parallel: int,
    micro_batch_tokens: int,
    distributed_optimizer: bool = True,
    precision: Precision = "bf16",
    recompute: Recompute = "selective",
    sequence_parallel: bool = True,
    fused_attention: bool = True,
    expert_parallel: int = 1,
    routing_replay: bool = False,
) -> list[StageMemory]:
    """Per-stage memory of one GPU (see the module docstring for the model and its sources), stage 0 first.

    ``sequence_parallel`` is whether it is in effect (it needs TP > 1); ``fused_attention`` whether the attention
    kernel keeps no score matrix (Transformer Engine) or megatron's local attention is used; ``expert_parallel``
    ranks (of the ``data_parallel`` ones) share a MoE model's experts; ``routing_replay``: the routers replay
    recorded choices.
    """
    check_parallel_layout(spec, tensor_parallel, pipeline_parallel, expert_parallel)
    if data_parallel % expert_parallel:
        raise ValueError(f"expert_parallel ({expert_parallel}) must divide data_parallel ({data_parallel})")
    if data_parallel < 1 or micro_batch_tokens < 1:
        raise ValueError(f"data_parallel ({data_parallel}) and micro_batch_tokens ({micro_batch_tokens}) must be >= 1")
    if precision not in ("fp32", "bf16", "fp8"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp8', got {precision!r}")
    if recompute not in ("selective", "full", "none"):
        raise ValueError(f"recompute must be 'selective', 'full' or 'none', got {recompute!r}")
    sequence_parallel = sequence_parallel and tensor_parallel > 1
    tp, pp, t, h = tensor_parallel, pipeline_parallel, micro_batch_tokens, spec.hidden_size
    sp = tp if sequence_parallel else 1
    weight_bytes = 4 if precision == "fp32" else 2
    act_bytes = 4 if precision == "fp32" else 2
    optimizer_per_param = (8 + (0 if precision == "fp32" else 4)) / (data_parallel if distributed_optimizer else 1)
    # experts' optimizer state is sharded over their own data-parallel group, D / X ranks
    expert_optimizer_per_param = optimizer_per_param * expert_parallel if distributed_optimizer else optimizer_per_param
    vocab_rows = padded_vocab_size(spec.vocab_size, tp) * h // tp
    layers = spec.num_layers // pp

    per_layer_values = activation_values_per_token(spec, tp, sequence_parallel=sequence_parallel) * t
    softmax_values = 0.0 if fused_attention or recompute != "none" else spec.num_attention_heads / tp * t * t
    if recompute == "full":
        kept_per_layer = h / sp * t
        working_set = per_layer_values + (0.0 if fused_attention else spec.num_attention_heads / tp * t * t)
    else:
        kept_per_layer = per_layer_values + softmax_values
        working_set = 0.0

    stages = []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        experts = layers * moe_layer_parameters(spec, tp, expert_parallel)
        parameters = layers * layer_parameters(spec, tp) + experts
        if first:
            parameters += vocab_rows
        if last:
            parameters += h + (vocab_rows if not (spec.tie_embeddings and pp == 1) else 0)
        in_flight = pp - stage
        activation_values = in_flight * (layers * kept_per_layer + (2 * h / sp * t if last else 0)) + working_set
        activations = int(activation_values * act_bytes)
        logits = 0
        if last:
            logits = sum(logprob_buffers(t * (padded_vocab_size(spec.vocab_size, tp) // tp), act_bytes).values())
        routing = 0
        if routing_replay and spec.moe is not None:
            holding = in_flight if recompute == "full" else 1
            routing = holding * -(-t // sp) * layers * spec.moe.topk * REPLAY_TARGET_BYTES
        stages.append(StageMemory(
            stage=stage, layers=layers, parameters=parameters, micro_batches_in_flight=in_flight,
            routing_bytes=routing,
            params_bytes=parameters * weight_bytes, grads_bytes=parameters * 4,
            optimizer_bytes=int((parameters - experts) * optimizer_per_param + experts * expert_optimizer_per_param),
            activations_bytes=activations,
            logits_bytes=logits, margin_bytes=int(FIXED_MARGIN_BYTES + FRAGMENTATION * (activations + logits)),
            expert_parameters=experts,
        ))
    return stages


def memory_table(stages: list[StageMemory], *, gpu_memory_gb: float) -> str:
    """A fixed-width table, one row per stage, in GB (10⁹ bytes), with whether each fits ``gpu_memory_gb``."""
    columns = ("params", "grads", "optimizer", "activations", "logits", "margin", "total")
    header = f"{'stage':>5} {'layers':>6} {'params/GPU':>11} {'in flight':>9} " + " ".join(f"{c:>11}" for c in columns)
    lines = [header + "  fits", "-" * (len(header) + 6)]
    for s in stages:
        values = (s.params_bytes, s.grads_bytes, s.optimizer_bytes, s.activations_bytes, s.logits_bytes,
                  s.margin_bytes, s.total_bytes)
        lines.append(f"{s.stage:>5} {s.layers:>6} {s.parameters / 1e9:>10.3f}B {s.micro_batches_in_flight:>9} "
                     + " ".join(f"{v / GB:>9.1f}GB" for v in values)
                     + f"  {'yes' if s.total_bytes <= gpu_memory_gb * GB else 'NO'}")
    return "\n".join(lines)


def plan_stages(config: DAPOConfig, spec: ModelSpec, *, data_parallel: int, local_spec: bool = False
                ) -> tuple[list[StageMemory], bool]:
    """(the per-stage estimate, whether sequence parallelism is in effect) for ``config``'s layout."""
    p = config.parallel
    sequence_parallel = sequence_parallel_enabled(p.sequence_parallel, tensor_parallel=p.tensor,
                                                  use_transformer_engine=not local_spec)
    stages = estimate_memory(
        spec, tensor_parallel=p.tensor, pipeline_parallel=p.pipeline, data_parallel=data_parallel,
        micro_batch_tokens=config.trainer.micro_batch_tokens, distributed_optimizer=p.use_distributed_optimizer,
        precision=config.model.precision, recompute=config.model.recompute, sequence_parallel=sequence_parallel,
        fused_attention=not local_spec, expert_parallel=p.expert,
        routing_replay=config.algorithm.moe_routing_replay != "none",
    )
    return stages, sequence_parallel
