"""``parallel:``: how the policy is split over the training ranks (megatron's tensor, pipeline, expert and data
parallelism) and how their collectives run."""

from __future__ import annotations

from dataclasses import dataclass

from dapo_megatron.config.errors import require, require_finite_numbers


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    # A mixture-of-experts model's experts split over this many of the data-parallel ranks (megatron's expert
    # parallelism, tokens exchanged by all-to-all); must divide the data-parallel size and the number of experts.
    expert: int = 1
    data: int | None = None  # derived from the world size; when given, it must agree
    use_distributed_optimizer: bool = True
    # How long a training collective may wait (every process group, megatron's TP/PP/DP/EP groups included; on GPU
    # NCCL's watchdog aborts at it) and how long a rank may go unheard before the job ends, naming it
    # (dapo_megatron/run/watchdog.py). Ranks waiting for rank 0's rollouts or validation wait in a gloo group of
    # their own without this limit (dapo_megatron.rank_zero): rank 0 still sends its heartbeat meanwhile.
    collective_timeout_s: float = 600.0
    # The collectives' limit while doing what is legitimately slow: the first step after a start (kernel
    # compilation, autotuning) and checkpoint writes and loads (a big model's shards on a shared filesystem).
    slow_collective_timeout_s: float = 3600.0
    # Each rank's heartbeat in the job's rendezvous store, read by every other rank (off: only the collectives'
    # timeouts bound a stopped rank, and a rank waiting for rank 0 waits for good).
    watchdog: bool = True
    # Split the activations between the tensor-parallel collectives over the TP ranks (megatron's sequence
    # parallelism). Takes effect where megatron supports it: the Transformer Engine layer spec with TP > 1.
    sequence_parallel: bool = True
    # Overlap the DP gradient reduce-scatter/all-reduce with the backward pass, and (distributed optimizer only) the
    # parameter all-gather with the next forward pass. Off by default: on CPU/gloo there is nothing to overlap with.
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # One GPU's memory (10^9 bytes) this layout is meant for: the default of `dapo-megatron plan --gpu-memory-gb`.
    gpu_memory_gb: float | None = None  # unset: 80
    # One node's host memory (10^9 bytes) a step may fill (routing replay's routing, a colocated optimizer's state):
    # checked by `dapo-megatron plan` (unset: 1000) and by the input checks before a launch (unset: this node's RAM).
    host_memory_gb: float | None = None

    def validate(self) -> None:
        require_finite_numbers(self, "parallel.")
        require(self.expert >= 1, "parallel.expert", f"must be >= 1, got {self.expert}")
        require(self.collective_timeout_s > 0, "parallel.collective_timeout_s",
                f"must be > 0, got {self.collective_timeout_s}")
        require(self.slow_collective_timeout_s >= self.collective_timeout_s, "parallel.slow_collective_timeout_s",
                f"must be >= parallel.collective_timeout_s ({self.collective_timeout_s:g}), got "
                f"{self.slow_collective_timeout_s:g}")
        require(self.host_memory_gb is None or self.host_memory_gb > 0, "parallel.host_memory_gb",
                f"must be > 0 (or null), got {self.host_memory_gb}")
        require(not self.overlap_param_gather or self.use_distributed_optimizer, "parallel.overlap_param_gather",
                "needs parallel.use_distributed_optimizer: true (only the distributed optimizer all-gathers "
                "parameters)")
