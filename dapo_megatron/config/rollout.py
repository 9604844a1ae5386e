"""``rollout:``: how the training samples are generated: by which engine (SGLang servers or the in-process
embedded engine), how many per prompt, how they are sampled, and where the servers run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dapo_megatron.config.errors import require, require_finite_numbers
from dapo_megatron.config.tools import ToolsConfig


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
    # samples on the servers at once, whatever the requests carry (a prompt's n, a multi-turn turn's 1); null: what
    # the servers run at once, Σ over servers of SGLang's running-request limit (dapo_megatron/rollout/sglang/pool.py)
    max_in_flight_samples: int | None = None
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

    def validate(self) -> None:
        """Called by :meth:`RolloutConfig.validate`, which also checks that the numbers are finite."""
        require(self.num_servers >= 1 or bool(self.urls), "rollout.sglang.num_servers", "must be >= 1")
        require(self.tp_per_server >= 1, "rollout.sglang.tp_per_server", "must be >= 1")
        require(self.launch_timeout_s > 0, "rollout.sglang.launch_timeout_s", "must be > 0")
        require(self.request_timeout_s > 0, "rollout.sglang.request_timeout_s", "must be > 0")
        require(self.max_restarts >= 0, "rollout.sglang.max_restarts", "must be >= 0")
        require(self.max_in_flight_samples is None or self.max_in_flight_samples >= 1,
                "rollout.sglang.max_in_flight_samples", "must be >= 1 or null (derived from the servers)")
        require(self.reply_processes >= 0, "rollout.sglang.reply_processes",
                f"must be >= 0 (0: in rank 0's process), got {self.reply_processes}")
        require(self.base_gpu_id is None or self.base_gpu_id >= 0, "rollout.sglang.base_gpu_id",
                f"must be >= 0 (or null), got {self.base_gpu_id}")
        require(self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
                "rollout.sglang.mem_fraction_static", f"must be in (0, 1) (or null), got {self.mem_fraction_static}")


@dataclass
class EmbeddedConfig:
    """The in-process engine (``rollout.engine: embedded``, dapo_megatron/rollout/embedded/engine.py): how it
    batches."""

    max_batch_rows: int = 512  # most sample rows decoded together (a chunk)
    max_kv_cache_mb: float = 2048  # MiB of KV cache per chunk; chunks get fewer rows so rows x positions fit
    # Finished rows leave the batch once they are at least this share of it (0: as soon as one finishes; above 1:
    # never). Dropping shrinks every later forward but copies the cache once.
    drop_finished_fraction: float = 0.25

    def validate(self) -> None:
        """Called by :meth:`RolloutConfig.validate`, which also checks that the numbers are finite."""
        require(self.max_batch_rows >= 1, "rollout.embedded.max_batch_rows",
                f"must be >= 1, got {self.max_batch_rows}")
        require(self.max_kv_cache_mb > 0, "rollout.embedded.max_kv_cache_mb",
                f"must be > 0, got {self.max_kv_cache_mb}")
        require(self.drop_finished_fraction >= 0, "rollout.embedded.drop_finished_fraction",
                f"must be >= 0, got {self.drop_finished_fraction}")


@dataclass
class RolloutConfig:
    """The training rollouts. ``n_samples`` is G, the group size: responses sampled per training prompt, whose
    rewards are each other's baseline (not ``eval.n_samples``, the k of avg@k on the validation problems)."""

    engine: Literal["embedded", "sglang"] = "sglang"
    n_samples: int = 16  # G: responses per training prompt (the group an advantage is measured against)
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
    # Tool calls in rollouts (multi-turn, dapo_megatron/rollout/multi_turn.py; docs/tools-sandbox.md). Tool-output
    # tokens count in max_response_length.
    tools: ToolsConfig = field(default_factory=ToolsConfig)

    def validate(self) -> None:
        require_finite_numbers(self, "rollout.")
        require(self.n_samples >= 2, "rollout.n_samples",
                f"must be >= 2: a sample's advantage is its reward against the rest of its group, got {self.n_samples}")
        require(self.max_response_length >= 1, "rollout.max_response_length",
                f"must be >= 1, got {self.max_response_length}")
        require(self.temperature > 0, "rollout.temperature", "must be > 0 for RL sampling")
        require(self.max_staleness >= 1 or self.mode == "sync", "rollout.max_staleness",
                f"must be >= 1 in async mode (what is generated during a step trains in the next), "
                f"got {self.max_staleness}")
        self.sglang.validate()
        self._validate_placement()
        self.embedded.validate()
        self.tools.validate()
        # The async driver streams single-turn requests and continues them across weight updates; the multi-turn
        # loop drives its own requests turn by turn and does not run there (yet).
        require(not self.tools.enabled or self.mode == "sync", "rollout.tools.enabled",
                "multi-turn tool rollouts run in rollout.mode: sync only")

    def _validate_placement(self) -> None:
        separate, s = self.placement == "separate", self.sglang
        require(separate or self.engine == "sglang", "rollout.placement",
                "colocated places SGLang servers on the trainer's GPUs; it needs rollout.engine: sglang")
        require(separate or self.mode == "sync", "rollout.placement",
                "colocated servers hand their GPU memory to the training between generations; it needs "
                "rollout.mode: sync (async generates while the policy trains)")
        require(separate or s.transport != "distributed", "rollout.sglang.transport",
                "distributed cannot reach colocated servers: NCCL refuses a weight-update group with two members on "
                "one GPU; use tensor (CUDA IPC) or disk")
        require(separate or s.mem_fraction_static is not None, "rollout.sglang.mem_fraction_static",
                "must be set under rollout.placement: colocated (the servers' share of the GPU memory free when "
                "they start; SGLang's default leaves the trainer nothing); `dapo-megatron plan` shows what fits")
        require(not self.offload_optimizer or self.placement == "colocated", "rollout.offload_optimizer",
                "moves the optimizer state out of the way of colocated servers; it needs rollout.placement: "
                "colocated")
