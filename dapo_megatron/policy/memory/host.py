"""Host memory of a step per node, for ``dapo-megatron plan`` and the input checks before a launch: what routing
replay keeps on the host, and the optimizer state colocated ranks move there, summed over a node's ranks and checked
against ``parallel.host_memory_gb``.

Routing replay (``algorithm.moe_routing_replay``), int16 ids (:mod:`dapo_megatron.policy.moe_routing`):

* every rank keeps the routing its forward-only passes recorded (R2) or replayed (R3) until the step's last update:
  its DP share of the step's tokens, its sequence-parallel part of each row, its stage's layers (the *share*);
  under R3 also the targets of the pass being run, the same share of one mini-batch;
* under R3 global rank 0 holds the engine's routing of what it collects: every layer of every sample, the batch
  it fills and one generation round in flight (the sync collector keeps the round's groups until they are
  filtered), at the prompt and response limits. No other rank receives it whole: each gets its share from rank 0
  (:mod:`dapo_megatron.policy.rollout_routing`).

All figures are upper bounds: every sample at ``data.max_prompt_length + rollout.max_response_length``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo_megatron.config import DAPOConfig
from dapo_megatron.policy.memory.gpu import GB, StageMemory
from dapo_megatron.policy.model_spec import ModelSpec
from dapo_megatron.policy.moe_routing import recorded_routing_bytes
from dapo_megatron.policy.rollout_routing import rollout_routing_bytes

DEFAULT_HOST_MEMORY_GB = 1000.0  # `plan` without parallel.host_memory_gb or --host-memory-gb: a common 8-GPU node
DEFAULT_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class HostMemory:
    """Host bytes per rank and per node of one step (see the module docstring)."""

    share_bytes: int  # every rank: the routing it keeps for the updates, and under R3 one pass's targets
    rank0_bytes: int  # global rank 0: the engine's routing it collects (R3)
    offload_bytes: int  # a rank of rank 0's node whose GPU a colocated server shares: its optimizer state
    ranks_per_node: int
    offloading_ranks: int  # of rank 0's node
    nodes: int = 1

    @property
    def first_node_bytes(self) -> int:
        """Rank 0's node, the fullest: its ranks' shares, rank 0's collection, the moved optimizer states."""
        return self.ranks_per_node * self.share_bytes + self.rank0_bytes + self.offloading_ranks * self.offload_bytes

    @property
    def other_node_bytes(self) -> int:
        return self.ranks_per_node * self.share_bytes


def step_tokens_per_rank(config: DAPOConfig, *, samples: int, data_parallel: int, sequence_parallel: bool) -> int:
    """The tokens of ``samples`` samples at the length limits that one rank routes: its DP share, its part of each
    row under sequence parallelism."""
    c = config
    split = c.parallel.tensor if sequence_parallel else 1
    return -(-samples * (c.data.max_prompt_length + c.rollout.max_response_length) // (data_parallel * split))


def routing_host_bytes(config: DAPOConfig, spec: ModelSpec, stages: list[StageMemory], *, data_parallel: int,
                       sequence_parallel: bool) -> tuple[int, int]:
    """(per rank, global rank 0's collection) bytes of routing replay on the host; (0, 0) without it."""
    c, replay = config, config.algorithm.moe_routing_replay
    if spec.moe is None or replay == "none":
        return 0, 0
    layers, topk = max(stage.layers for stage in stages), spec.moe.topk
    step = step_tokens_per_rank(c, samples=c.trainer.train_batch_size * c.rollout.n_samples,
                                data_parallel=data_parallel, sequence_parallel=sequence_parallel)
    share = recorded_routing_bytes(tokens=step, layers=layers, topk=topk)
    if replay != "replay_rollout":
        return share, 0
    one_pass = step_tokens_per_rank(c, samples=c.trainer.mini_batch_size * c.rollout.n_samples,
                                    data_parallel=data_parallel, sequence_parallel=sequence_parallel)
    share += recorded_routing_bytes(tokens=one_pass, layers=layers, topk=topk)
    a = c.algorithm
    prompts_per_round = a.gen_batch_size if a.dynamic_sampling else c.trainer.train_batch_size
    collected = (c.trainer.train_batch_size + prompts_per_round) * c.rollout.n_samples
    per_sample = rollout_routing_bytes(tokens=c.data.max_prompt_length + c.rollout.max_response_length - 1,
                                       layers=spec.num_layers, topk=topk)
    return share, collected * per_sample


def host_memory(config: DAPOConfig, spec: ModelSpec, stages: list[StageMemory], *, data_parallel: int,
                sequence_parallel: bool, ranks_per_node: int, offloading_ranks: int = 0) -> HostMemory:
    """The step's host memory; ``offloading_ranks`` of rank 0's node move their optimizer state (the largest
    stage's) to the host while colocated servers generate."""
    share, rank0 = routing_host_bytes(config, spec, stages, data_parallel=data_parallel,
                                      sequence_parallel=sequence_parallel)
    world = config.parallel.tensor * config.parallel.pipeline * data_parallel
    return HostMemory(share_bytes=share, rank0_bytes=rank0,
                      offload_bytes=max(stage.optimizer_bytes for stage in stages) if offloading_ranks else 0,
                      ranks_per_node=ranks_per_node, offloading_ranks=offloading_ranks,
                      nodes=-(-world // ranks_per_node))


def host_memory_lines(memory: HostMemory, config: DAPOConfig, *, budget_gb: float) -> tuple[list[str], bool]:
    """``plan``'s lines on the host, and whether rank 0's node fits ``budget_gb``."""
    if not (memory.share_bytes or memory.rank0_bytes or memory.offload_bytes):
        return [], True
    fits = memory.first_node_bytes <= budget_gb * GB
    parts = [f"{memory.ranks_per_node} ranks x {memory.share_bytes / GB:.2f} GB of routing replay "
             f"({config.algorithm.moe_routing_replay}: each rank's share of the step, at the length limits)"
             ] if memory.share_bytes else []
    if memory.rank0_bytes:
        parts.append(f"rank 0's {memory.rank0_bytes / GB:.2f} GB of the engine's routing (the batch and one "
                     f"generation round, every layer)")
    if memory.offloading_ranks:
        parts.append(f"{memory.offloading_ranks} x {memory.offload_bytes / GB:.1f} GB of optimizer state moved there "
                     f"while colocated servers generate")
    others = f", {memory.other_node_bytes / GB:.1f} GB on each other node" if memory.nodes > 1 else ""
    lines = [f"host memory per node: {memory.first_node_bytes / GB:.1f} GB on rank 0's node ({' + '.join(parts)})"
             f"{others}: " + ("fits" if fits else "does NOT fit") + f" in {budget_gb:g} GB (parallel.host_memory_gb)"]
    return lines, fits
