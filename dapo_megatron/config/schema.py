"""The one configuration schema: typed dataclasses whose defaults are the paper's recipe (Qwen2.5-32B, DAPO).

A run is configured by, in order of precedence:  command-line dotted overrides (``rollout.n_samples=8``)  >  a YAML
file (``examples/*.yaml``)  >  these defaults. Unknown keys and badly typed values are rejected with the dotted key
named (:mod:`dapo_megatron.config.loading`). The resolved config is written to the run directory as
``config.yaml``.

Where the paper / the published recipe fixes a number, the default is that number:
clip ε_low/ε_high 0.2/0.28, dual-clip c = 10, token-mean loss, no KL, G = 16 samples per prompt, 512 prompts per step,
1536 prompts per generation round, at most 10 generation rounds, mini-batch 32 prompts (16 updates per step),
max prompt 2048 / response 20480 tokens, overlong buffer 4096 with factor 1.0, lr 1e-6 with 10 warmup steps,
weight decay 0.1, grad clip 1.0, rollout temperature 1.0 / top-p 1.0, validation top-p 0.7 with avg@32.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Literal

from dapo_megatron.user_errors import UserError


class ConfigError(UserError, ValueError, kind="config"):
    """A configuration key is unknown or its value is invalid; the message names the dotted key."""


# --------------------------------------------------------------------------------------------------- sections


@dataclass
class TinyModelConfig:
    """A random-init model built locally (the CPU demo and tests); used when ``model.source = tiny``. ``arch``:
    Qwen2-style (the default), Qwen3 (q/k norms, ``head_dim`` of its own) or Qwen3-MoE (Qwen3 attention, every MLP
    ``num_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per token)."""

    arch: Literal["qwen2", "qwen3", "qwen3_moe"] = "qwen2"
    hidden_size: int = 128
    num_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    head_dim: int | None = None  # qwen3 / qwen3_moe; null: hidden_size / num_attention_heads
    num_experts: int = 8  # qwen3_moe
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True


@dataclass
class MoEConfig:
    """Training settings of a mixture-of-experts policy (Qwen3-MoE); the model's shape comes from its config.json."""

    # Weight of megatron's Switch load-balancing loss per MoE layer, added to the policy loss. 0: the policy loss
    # alone (RL steps are small; balance is then only watched: actor/moe_aux_loss and actor/moe_load_imbalance are
    # logged either way). Qwen3-MoE was pretrained with 0.001 (its config's router_aux_loss_coef).
    aux_loss_coeff: float = 0.0


Kernels = Literal["auto", "transformer_engine", "local"]
Recompute = Literal["selective", "full", "none"]
Precision = Literal["fp32", "bf16", "fp8"]


@dataclass
class ModelConfig:
    source: Literal["hf", "tiny"] = "hf"
    hf_path: str | None = None  # HF folder: config.json, safetensors, tokenizer files
    tokenizer_path: str | None = None  # defaults to hf_path (tiny: a tokenizer trained locally)
    precision: Precision = "bf16"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    # Activation recomputation on GPU (policy/model.py): "selective" recomputes the core attention in backward
    # (megatron's default selective set: the attention scores/softmax are what it would otherwise keep); "full" keeps
    # only each layer's input and recomputes the whole layer; "none" keeps everything. Without CUDA it is off (memory
    # is not the limit there, it would only cost time). `dapo-megatron plan CONFIG` shows the memory per GPU.
    recompute: Recompute = "selective"
    # The policy's layers on CUDA (dapo_megatron.backend): "auto" takes Transformer Engine when it imports, else
    # megatron's local layers with torch's SDPA attention, and logs that; "transformer_engine" refuses to start
    # without it; "local" takes the local layers on purpose. Without CUDA the CPU layers run (dapo_megatron.cpu).
    kernels: Kernels = "auto"
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    # A mixture-of-experts model's experts split over this many of the data-parallel ranks (megatron's expert
    # parallelism, tokens exchanged by all-to-all); must divide the data-parallel size and the number of experts.
    expert: int = 1
    data: int | None = None  # derived from the world size; when given, it must agree
    use_distributed_optimizer: bool = True
    # Timeout of the training collectives. Ranks waiting for rank 0's rollouts or validation wait in a gloo group
    # of their own without this limit (dapo_megatron.rank_zero).
    collective_timeout_s: float = 7200.0
    # Split the activations between the tensor-parallel collectives over the TP ranks (megatron's sequence
    # parallelism). Takes effect where megatron supports it: the Transformer Engine layer spec with TP > 1.
    sequence_parallel: bool = True
    # Overlap the DP gradient reduce-scatter/all-reduce with the backward pass, and (distributed optimizer only) the
    # parameter all-gather with the next forward pass. Off by default: on CPU/gloo there is nothing to overlap with.
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False


@dataclass
class SyntheticDataConfig:
    """The integer-answer synthetic task (the CPU demo)."""

    seed: int = 0
    num_train: int = 4000
    num_heldout: int = 300


@dataclass
class TrainSourceConfig:
    """One training source of a mixture (``data.train``): a parquet / jsonl file in the DAPO-Math-17K (verl) schema,
    a folder written by HF ``datasets``' ``save_to_disk``, or a folder of parquet / jsonl shards."""

    path: str = ""
    weight: float = 1.0  # share of the prompts drawn = weight / sum of the weights
    name: str | None = None  # what per-source metrics call it; default: its rows' data_source


@dataclass
class DataConfig:
    source: Literal["dapo_math", "synthetic"] = "dapo_math"
    train_files: list[str] = field(default_factory=list)  # parquet / jsonl in the DAPO-Math-17K schema: one pool
    # Several sources mixed by weight (dapo_megatron/data/mixture.py); instead of train_files.
    train: list[TrainSourceConfig] = field(default_factory=list)
    # A folder source with more rows than this is read when drawn (memory-mapped arrow, rows validated as drawn, no
    # deduplication) instead of being loaded, validated and deduplicated at start.
    stream_above_rows: int = 200_000
    val_files: list[str] = field(default_factory=list)  # e.g. AIME-2024 in the same schema
    max_prompt_length: int = 2048
    on_bad_row: Literal["error", "skip"] = "error"
    integer_answers: bool = True
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)


@dataclass
class SGLangConfig:
    urls: list[str] = field(default_factory=list)  # attach to these servers; empty: launch num_servers locally
    num_servers: int = 1
    tp_per_server: int = 1
    python: str | None = None  # interpreter that has sglang; default: this one
    host: str = "127.0.0.1"
    # Launched server i listens on base_port + i; 0 (the default): a free port each, so runs sharing a machine never
    # meet (a taken fixed port is refused by name before the launch).
    base_port: int = 0
    api_key_file: str | None = None  # attached servers: the key they were started with
    transport: Literal["disk", "tensor", "distributed"] = "disk"
    weight_dir: str | None = None  # disk transport: a directory the servers can read (shared fs on SLURM)
    launch_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    max_restarts: int = 2
    # /generate requests in flight at once (each a prompt with its n samples); null: what the servers run at once,
    # Σ over servers of ceil(SGLang's running-request limit / n) (dapo_megatron/rollout/sglang/pool.py)
    max_concurrent_requests: int | None = None
    # 0: /generate calls and their JSON parsing run in threads of rank 0's process (the GIL they hold slows the
    # kernel launches of rank 0, everyone's straggler); N > 0: in N worker processes of their own, which return
    # compact arrays (dapo_megatron/rollout/sglang/reply_workers.py)
    reply_processes: int = 0
    extra_server_args: list[str] = field(default_factory=list)
    # distributed transport: the address of trainer rank 0 the servers dial; default: this host's address on the
    # route to the first server (dapo_megatron/host_address.py)
    weight_update_address: str | None = None
    # Launched servers on GPUs: server i with tp_per_server T gets GPUs [base + i*T, base + (i+1)*T) of this node;
    # null: base = the number of trainer ranks on the node (the GPUs right after the trainer's).
    base_gpu_id: int | None = None
    mem_fraction_static: float | None = None  # SGLang's share of its GPUs for weights + KV cache; null: SGLang's


@dataclass
class EmbeddedConfig:
    """The in-process engine (``rollout.engine: embedded``, dapo_megatron/rollout/embedded/engine.py): how it batches."""

    max_batch_rows: int = 512  # most sample rows decoded together (a chunk)
    max_kv_cache_mb: float = 2048  # MiB of KV cache per chunk; chunks get fewer rows so rows x positions fit
    # Finished rows leave the batch once they are at least this share of it (0: as soon as one finishes; above 1:
    # never). Dropping shrinks every later forward but copies the cache once.
    drop_finished_fraction: float = 0.25


@dataclass
class RolloutConfig:
    engine: Literal["embedded", "sglang"] = "sglang"
    n_samples: int = 16  # G
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_length: int = 20480
    handoff_bucket_mb: float = 512  # MiB per weight-handoff bucket (a larger tensor travels alone)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    # sync: generate → train → hand off, one after the other (the paper). async: a background driver on rank 0 keeps
    # generating the next steps' groups while the policy trains (dapo_megatron/collectors/asynchronous.py).
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 1  # async: a group trains only while policy version − its oldest token's version <= this
    partial_rollouts: bool = True  # async: generations in flight at a weight update continue on the new weights
    # Where launched SGLang servers run: "separate" GPUs (after the trainer's on a node, or other nodes), or
    # "colocated" on the trainer's own GPUs, taking turns with it: the servers release their weights and KV cache
    # while the policy trains and take them back for the weight handoff and generation (rollout/placement.py).
    placement: Literal["separate", "colocated"] = "separate"
    # colocated, on GPUs: the optimizer state (fp32 main parameters, Adam moments) waits in host memory while the
    # servers generate, leaving that much more GPU memory to them (trainer/colocation.py).
    offload_optimizer: bool = False


@dataclass
class GSPOConfig:
    """``algorithm.policy_loss: gspo / gspo_token``: the sequence-ratio clip range (dapo_megatron/algorithm/gspo.py).
    The paper's: a sequence ratio moves far less than a token ratio, so DAPO's 0.2 / 0.28 would hardly ever clip."""

    eps_low: float = 3e-4
    eps_high: float = 4e-4


@dataclass
class CISPOConfig:
    """``algorithm.policy_loss: cispo``: the range of the stop-gradient IS weight (dapo_megatron/algorithm/cispo.py).
    eps_low_is = 1: no lower bound, as MiniMax-M1; eps_high_is = 3: a weight cap of 4 (the paper leaves it
    unpublished; 4 is Tinker's documented CISPO default)."""

    eps_low_is: float = 1.0
    eps_high_is: float = 3.0


@dataclass
class AlgorithmConfig:
    # The objective, by registry name (dapo_megatron/algorithm/objectives.py): the policy loss ("dapo", "gspo",
    # "gspo_token", "cispo") and the advantage estimator ("grpo"). eps_low/eps_high/clip_ratio_c are dapo's.
    policy_loss: str = "dapo"
    advantage_estimator: str = "grpo"
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    cispo: CISPOConfig = field(default_factory=CISPOConfig)
    eps_low: float = 0.2
    eps_high: float = 0.28  # clip-higher; = eps_low gives GRPO's symmetric clip
    clip_ratio_c: float | None = 10.0  # dual clip for negative advantages
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    advantage_eps: float = 1e-6
    overlong_filtering: bool = True  # zero the loss mask of truncated samples
    overlong_penalty: bool = True  # soft overlong punishment
    overlong_buffer_len: int = 4096  # L_cache
    overlong_penalty_factor: float = 1.0
    dynamic_sampling: bool = True
    gen_batch_size: int = 1536  # prompts per generation round
    max_gen_rounds: int = 10  # at the cap the step trains on what it has (and logs it)
    # Groups collected beyond the batch (sync mode): "drop" them (the reference recipe), or "keep" them for the next
    # step, where they are off-policy by one version. "auto": keep when rollout_correction corrects them, else drop.
    surplus_policy: Literal["auto", "keep", "drop"] = "auto"
    use_math_verify: bool = False  # symbolic fallback after the DAPO exact match
    # Correction of the gap between the engine that sampled a token and the policy (different kernels, older
    # weights): token-level truncated IS, sequence-level masked IS, or both (dapo_megatron/algorithm/
    # rollout_correction.py). "none" trains tokens as sampled, except tokens of older weight versions in async mode,
    # which are masked out of the loss.
    rollout_correction: Literal["none", "token_tis", "seq_mis", "both"] = "none"
    tis_cap: float = 2.0  # token_tis: weight = min(π_old / π_rollout, tis_cap)
    mis_threshold: float = 2.0  # seq_mis: drop a response whose geometric-mean ratio leaves [1/τ, τ]
    # Mixture-of-experts policies: "replay_old" records which experts π_old's forward chose for every token and makes
    # each update's forward use the same ones (megatron's RouterReplay), so a routing flip between the two passes
    # cannot move the importance ratio; "none" lets each forward route by itself (dapo_megatron/policy/moe_routing.py).
    moe_routing_replay: Literal["none", "replay_old"] = "none"

    @property
    def resolved_surplus_policy(self) -> Literal["keep", "drop"]:
        """``surplus_policy`` with "auto" resolved: surplus groups are kept only when the rollout correction will
        correct them as the stale samples they are."""
        if self.surplus_policy != "auto":
            return self.surplus_policy
        return "drop" if self.rollout_correction == "none" else "keep"


@dataclass
class FormatRewardConfig:
    """Soft format enforcement: a bonus ``weight(step)`` for a response that matches ``pattern``, where weight falls
    linearly from ``weight`` at step 0 to 0 at ``decay_steps``. Added to the score the advantages use, never to the
    correctness dynamic sampling filters on. Off (weight 0) by default, as in the paper's recipe."""

    weight: float = 0.0
    decay_steps: int = 100
    pattern: str = r"(?im)^[ \t]*Answer[ \t]*:[ \t]*\S"  # a line starting with "Answer:" and an answer


@dataclass
class RewardConfig:
    """What scores a response (dapo_megatron/reward/). Default: the built-in DAPO math rule (+1 / -1)."""

    # Your reward: "path/to/file.py:name" or "package.module:name" (name defaults to compute_score), with verl's
    # signature compute_score(data_source, solution_str, ground_truth, extra_info) -> float | {"score", "acc", ...};
    # a group at a time with verl's batched names (data_sources, solution_strs, ground_truths, extra_infos); or async.
    function: str | None = None
    url: str | None = None  # a reward service: POST of a group in verl's batched names, a JSON list back
    num_workers: int = 4  # worker processes for `function` (concurrent HTTP requests for `url`)
    # The built-in rule in those worker processes too, not in trainer rank 0, whose GIL it would hold while rank 0
    # launches kernels every other rank waits on (the GPU examples turn it on; a CPU run needs no extra processes).
    builtin_in_workers: bool = False
    async_concurrency: int = 16  # an async function: calls in flight per worker process
    timeout_s: float = 60.0  # per call: a sample, or a group for the batched form / a url request
    error_score: float = -1.0  # the score of a sample whose reward raised or timed out (counted, never correct)
    url_retries: int = 3  # a failed url request is retried this many times, with backoff
    format: FormatRewardConfig = field(default_factory=FormatRewardConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    warmup_steps: int = 10
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class WarmStartConfig:
    """Supervised warm-start on reference solutions (synthetic task only): gives a random tiny model the format."""

    enabled: bool = False
    max_steps: int = 400
    batch_size: int = 128
    lr: float = 3e-3
    eval_every: int = 20
    stop_at_accuracy: float = 0.35  # stop early: RL needs groups with mixed outcomes


@dataclass
class WandbConfig:
    project: str = "dapo-megatron"
    entity: str | None = None
    name: str | None = None  # default: the run directory's name
    mode: Literal["online", "offline"] = "online"  # offline: files under run_dir/wandb, `wandb sync` them later


@dataclass
class MlflowConfig:
    tracking_uri: str | None = None  # default: sqlite:///<run_dir>/mlflow.db
    experiment: str = "dapo-megatron"
    run_name: str | None = None  # default: the run directory's name


# Words with which a model revisits its own reasoning (the paper's "emergence of reflective reasoning").
REFLECTION_PHRASES = ("wait", "let me check", "let me verify", "recheck", "re-check", "double-check", "double check",
                      "reconsider", "re-evaluate", "mistake")


@dataclass
class TrainerConfig:
    total_steps: int = 100
    train_batch_size: int = 512  # groups (prompts) per step
    mini_batch_size: int = 32  # groups per optimizer update
    micro_batch_tokens: int = 32768  # packing budget per micro-batch
    seed: int = 42
    run_dir: str = "runs/dapo"
    save_every: int = 10  # 0: only at the end
    keep_checkpoints: int = 3  # of this run, the newest; 0: every one
    tensorboard: bool = True  # false removes tensorboard from `loggers`
    # Where the scalars go besides metrics.jsonl (dapo_megatron/metrics/loggers.py); wandb and mlflow are extras:
    # pip install 'dapo-megatron[wandb]' / '[mlflow]'.
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["tensorboard"])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    # response/reflection_rate: the fraction of responses with one of these (case-insensitive, whole words)
    reflection_phrases: list[str] = field(default_factory=lambda: list(REFLECTION_PHRASES))


@dataclass
class EvalConfig:
    every: int = 10  # steps; 0: only before and after training
    n_samples: int = 32  # k of avg@k
    temperature: float = 1.0
    top_p: float = 0.7
    max_response_length: int | None = None  # default: rollout.max_response_length
    greedy: bool = False  # k = 1 greedy decoding instead (the CPU demo's held-out accuracy)
    max_problems: int | None = None
    log_generations: int = 8  # generations (prompt, response, answer, score) kept per validation; 0: none


@dataclass
class DAPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> "DAPOConfig":
        """Cross-field checks that a type cannot express. Returns self."""
        _require_finite_numbers(self)
        t, a, r = self.trainer, self.algorithm, self.rollout
        _require(t.train_batch_size >= 1, "trainer.train_batch_size", f"must be >= 1, got {t.train_batch_size}")
        _require(t.mini_batch_size >= 1, "trainer.mini_batch_size", f"must be >= 1, got {t.mini_batch_size}")
        _require(t.train_batch_size % t.mini_batch_size == 0, "trainer.mini_batch_size",
                 f"must divide trainer.train_batch_size ({t.train_batch_size}), got {t.mini_batch_size}")
        _require(r.n_samples >= 2, "rollout.n_samples",
                 f"must be >= 2: a sample's advantage is its reward against the rest of its group, got {r.n_samples}")
        _require(r.max_response_length >= 1, "rollout.max_response_length",
                 f"must be >= 1, got {r.max_response_length}")
        _require(0 <= a.eps_low < 1, "algorithm.eps_low", f"must be in [0, 1), got {a.eps_low}")
        _require(a.eps_high >= 0, "algorithm.eps_high", f"must be >= 0, got {a.eps_high}")
        _require(a.clip_ratio_c is None or a.clip_ratio_c > 1, "algorithm.clip_ratio_c",
                 f"must be > 1 (or null), got {a.clip_ratio_c}")
        from dapo_megatron.algorithm.objectives import check_names  # the registry imports this module

        check_names(a)
        _require(0 <= a.gspo.eps_low < 1, "algorithm.gspo.eps_low", f"must be in [0, 1), got {a.gspo.eps_low}")
        _require(a.gspo.eps_high >= 0, "algorithm.gspo.eps_high", f"must be >= 0, got {a.gspo.eps_high}")
        _require(a.cispo.eps_low_is >= 0, "algorithm.cispo.eps_low_is",
                 f"must be >= 0 (1 or more: no lower bound), got {a.cispo.eps_low_is}")
        _require(a.cispo.eps_high_is >= 0, "algorithm.cispo.eps_high_is", f"must be >= 0, got {a.cispo.eps_high_is}")
        _require(0 < a.overlong_buffer_len <= r.max_response_length or not a.overlong_penalty,
                 "algorithm.overlong_buffer_len",
                 f"must be in (0, rollout.max_response_length={r.max_response_length}], got {a.overlong_buffer_len}")
        _require(a.gen_batch_size >= 1, "algorithm.gen_batch_size", "must be >= 1")
        _require(a.max_gen_rounds >= 1, "algorithm.max_gen_rounds", "must be >= 1")
        _require(r.temperature > 0, "rollout.temperature", "must be > 0 for RL sampling")
        _require(r.max_staleness >= 1 or r.mode == "sync", "rollout.max_staleness",
                 f"must be >= 1 in async mode (what is generated during a step trains in the next), "
                 f"got {r.max_staleness}")
        _require(a.tis_cap > 0, "algorithm.tis_cap", f"must be > 0, got {a.tis_cap}")
        _require(a.mis_threshold > 1, "algorithm.mis_threshold", f"must be > 1, got {a.mis_threshold}")
        s = r.sglang
        _require(s.num_servers >= 1 or bool(s.urls), "rollout.sglang.num_servers", "must be >= 1")
        _require(s.tp_per_server >= 1, "rollout.sglang.tp_per_server", "must be >= 1")
        _require(s.launch_timeout_s > 0, "rollout.sglang.launch_timeout_s", "must be > 0")
        _require(s.request_timeout_s > 0, "rollout.sglang.request_timeout_s", "must be > 0")
        _require(s.max_restarts >= 0, "rollout.sglang.max_restarts", "must be >= 0")
        _require(s.max_concurrent_requests is None or s.max_concurrent_requests >= 1,
                 "rollout.sglang.max_concurrent_requests", "must be >= 1 or null (derived from the servers)")
        _require(s.reply_processes >= 0, "rollout.sglang.reply_processes",
                 f"must be >= 0 (0: in rank 0's process), got {s.reply_processes}")
        _require(s.base_gpu_id is None or s.base_gpu_id >= 0, "rollout.sglang.base_gpu_id",
                 f"must be >= 0 (or null), got {s.base_gpu_id}")
        _require(s.mem_fraction_static is None or 0 < s.mem_fraction_static < 1, "rollout.sglang.mem_fraction_static",
                 f"must be in (0, 1) (or null), got {s.mem_fraction_static}")
        _require(r.placement == "separate" or r.engine == "sglang", "rollout.placement",
                 "colocated places SGLang servers on the trainer's GPUs; it needs rollout.engine: sglang")
        _require(r.placement == "separate" or r.mode == "sync", "rollout.placement",
                 "colocated servers hand their GPU memory to the training between generations; it needs "
                 "rollout.mode: sync (async generates while the policy trains)")
        _require(r.placement == "separate" or s.transport != "distributed", "rollout.sglang.transport",
                 "distributed cannot reach colocated servers: NCCL refuses a weight-update group with two members on "
                 "one GPU; use tensor (CUDA IPC) or disk")
        _require(r.placement == "separate" or s.mem_fraction_static is not None, "rollout.sglang.mem_fraction_static",
                 "must be set under rollout.placement: colocated (the servers' share of the GPU memory free when "
                 "they start; SGLang's default leaves the trainer nothing); `dapo-megatron plan` shows what fits")
        _require(not r.offload_optimizer or r.placement == "colocated", "rollout.offload_optimizer",
                 "moves the optimizer state out of the way of colocated servers; it needs rollout.placement: "
                 "colocated")
        e = r.embedded
        _require(e.max_batch_rows >= 1, "rollout.embedded.max_batch_rows", f"must be >= 1, got {e.max_batch_rows}")
        _require(e.max_kv_cache_mb > 0, "rollout.embedded.max_kv_cache_mb", f"must be > 0, got {e.max_kv_cache_mb}")
        _require(e.drop_finished_fraction >= 0, "rollout.embedded.drop_finished_fraction",
                 f"must be >= 0, got {e.drop_finished_fraction}")
        _require(self.optim.lr > 0, "optim.lr", "must be > 0")
        _require(self.optim.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _require(self.optim.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)")
        p = self.parallel
        _require(p.expert >= 1, "parallel.expert", f"must be >= 1, got {p.expert}")
        _require(self.model.moe.aux_loss_coeff >= 0, "model.moe.aux_loss_coeff",
                 f"must be >= 0, got {self.model.moe.aux_loss_coeff}")
        dense_tiny = self.model.source == "tiny" and self.model.tiny.arch != "qwen3_moe"
        _require(not (dense_tiny and p.expert > 1), "parallel.expert",
                 f"expert parallelism needs a mixture-of-experts model (model.tiny.arch: qwen3_moe), got {p.expert}")
        _require(not (dense_tiny and a.moe_routing_replay != "none"), "algorithm.moe_routing_replay",
                 "replay_old needs a mixture-of-experts model (model.tiny.arch: qwen3_moe)")
        _require(not p.overlap_param_gather or p.use_distributed_optimizer, "parallel.overlap_param_gather",
                 "needs parallel.use_distributed_optimizer: true (only the distributed optimizer all-gathers "
                 "parameters)")
        _require(t.total_steps >= 0, "trainer.total_steps", "must be >= 0")
        _require(t.keep_checkpoints >= 0, "trainer.keep_checkpoints",
                 f"must be >= 0 (0 keeps every checkpoint), got {t.keep_checkpoints}")
        _require(t.save_every >= 0, "trainer.save_every", f"must be >= 0 (0: only at the end), got {t.save_every}")
        _require(self.data.max_prompt_length >= 1, "data.max_prompt_length",
                 f"must be >= 1, got {self.data.max_prompt_length}")
        syn = self.data.synthetic
        _require(syn.num_train >= 1, "data.synthetic.num_train", f"must be >= 1, got {syn.num_train}")
        _require(syn.num_heldout >= 0, "data.synthetic.num_heldout", f"must be >= 0, got {syn.num_heldout}")
        _require(t.micro_batch_tokens >= 1, "trainer.micro_batch_tokens", "must be >= 1")
        _require(self.model.source == "tiny" or self.model.hf_path, "model.hf_path",
                 "is required when model.source = hf")
        d = self.data
        _require(d.source == "synthetic" or bool(d.train_files) or bool(d.train), "data.train_files",
                 "(or data.train) is required when data.source = dapo_math")
        _require(not (d.train_files and d.train), "data.train",
                 "and data.train_files are two ways to give the training data: use one")
        _require(not d.train or d.source == "dapo_math", "data.train", "needs data.source = dapo_math")
        for i, source in enumerate(d.train):
            _require(bool(source.path), f"data.train[{i}].path", "is required")
            _require(source.weight > 0, f"data.train[{i}].weight", f"must be > 0, got {source.weight}")
        _require(d.stream_above_rows >= 0, "data.stream_above_rows", "must be >= 0")
        self._validate_reward()
        _require(self.eval.log_generations >= 0, "eval.log_generations", "must be >= 0")
        _require(not self.warm_start.enabled or self.data.source == "synthetic", "warm_start.enabled",
                 "needs reference solutions, which only data.source = synthetic provides")
        return self

    def _validate_reward(self) -> None:
        w = self.reward
        _require(not (w.function and w.url), "reward.url", "and reward.function are two rewards: give one")
        _require(not (w.builtin_in_workers and (w.function or w.url)), "reward.builtin_in_workers",
                 "moves the built-in rule; with reward.function or reward.url there is none to move")
        _require(w.num_workers >= 1, "reward.num_workers", f"must be >= 1, got {w.num_workers}")
        _require(w.async_concurrency >= 1, "reward.async_concurrency", f"must be >= 1, got {w.async_concurrency}")
        _require(w.timeout_s > 0, "reward.timeout_s", f"must be > 0, got {w.timeout_s}")
        _require(w.url_retries >= 0, "reward.url_retries", f"must be >= 0, got {w.url_retries}")
        _require(w.format.weight >= 0, "reward.format.weight", f"must be >= 0, got {w.format.weight}")
        _require(w.format.decay_steps >= 1, "reward.format.decay_steps", f"must be >= 1, got {w.format.decay_steps}")
        try:
            re.compile(w.format.pattern)
        except re.error as error:
            raise ConfigError(f"reward.format.pattern: not a regular expression: {error}") from None


def _require_finite_numbers(section: object, prefix: str = "") -> None:
    """Every float setting is a finite number: YAML reads .inf and .nan as floats, and an infinite learning rate
    would only show as NaN weights a step later."""
    for item in fields(section):
        value, key = getattr(section, item.name), f"{prefix}{item.name}"
        if is_dataclass(value):
            _require_finite_numbers(value, f"{key}.")
        elif isinstance(value, float):
            _require(math.isfinite(value), key, f"must be a finite number, got {value}")


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")
