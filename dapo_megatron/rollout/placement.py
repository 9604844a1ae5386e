"""Colocated placement (``rollout.placement: colocated``): SGLang servers on the trainer's GPUs, taking turns with it.

Under ``separate`` placement (the default) the servers have GPUs of their own and nothing here applies. Under
``colocated`` every launched server runs on the trainer's GPUs of rank 0's node (from GPU 0, or
``rollout.sglang.base_gpu_id``) and the GPU memory changes hands four times a step:

1. generation: the servers hold their weights, KV cache and CUDA graphs; the trainer its weights and gradients
   (and its optimizer state, unless ``rollout.offload_optimizer`` moved it to host memory:
   :mod:`dapo_megatron.trainer.colocation`);
2. after generating, the servers release their KV cache and CUDA graphs (``/release_memory_occupation``, tags
   ``kv_cache`` and ``cuda_graph``), and the optimizer state comes back;
3. before the policy update they release their weights (tag ``weights``): the training has the GPU but for the
   servers' CUDA contexts;
4. the weight handoff first resumes the servers' weights (``/resume_memory_occupation``, tag ``weights``), then pushes
   the new ones into them (the ``tensor`` transport: CUDA IPC handles, or ``disk``); before the next generation
   (or validation) the KV cache and CUDA graphs come back.

verl (its multi-stage wake-up) and slime resume in this order too: weights, new weights, then the KV cache, so that
the KV cache is not mapped while the trainer's handoff buckets still take room.

What this rests on (SGLang 0.5.23, ``scheduler_components/weight_updater.py`` and ``torch_memory_saver_adapter.py``;
the last two points measured against the CPU server):

* release and resume free and map memory only in a server started with ``--enable-memory-saver``
  (torch_memory_saver's CUDA virtual-memory regions; its package is a dependency of SGLang's GPU install). Without
  it they answer 200 and change nothing; the CPU server has no memory saver (it is CUDA-only), so on CPU the
  sequence runs and frees nothing;
* resumed regions do not get their contents back (no ``--enable-weights-cpu-backup``): weights are resumed only to
  receive new ones, and generating with released weights is refused here instead of decoding garbage. LoRA's
  adapter handoff pushes no weights after the start, so its servers run with that flag and get their base back
  (:mod:`dapo_megatron.rollout.sglang.lora_adapters`);
* resuming a tag that is not released kills the server (a ``KeyError`` in its scheduler ends the process), so the
  engine tracks what each server released (:class:`ServerMemory`) and only ever resumes that;
* a release needs an idle server (no running request): sync mode only (``config.schema`` refuses async).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from dapo_megatron.config import ConfigError, SGLangConfig
from dapo_megatron.rollout.engine import RolloutError
from dapo_megatron.rollout.sglang.client import SGLangServerError
from dapo_megatron.rollout.sglang.gpus import server_gpu_ranges
from dapo_megatron.rollout.sglang.server import MEMORY_SAVER_FLAG

Placement = Literal["separate", "colocated"]

# SGLang's memory tags (sglang/srt/constants.py: GPU_MEMORY_TYPE_*).
WEIGHTS = "weights"
KV_CACHE = "kv_cache"
CUDA_GRAPH = "cuda_graph"
GENERATION_MEMORY = (KV_CACHE, CUDA_GRAPH)
ALL_MEMORY = (WEIGHTS, KV_CACHE, CUDA_GRAPH)


def uses_memory_saver(placement: Placement, device: str) -> bool:
    """Whether a launched server starts with SGLang's memory saver: colocated on GPUs; a CPU server has none to
    start (see the module docstring)."""
    return placement == "colocated" and device == "cuda"


def check_attached_server(url: str, server_info: dict[str, Any]) -> None:
    """An attached server colocated on GPUs must have been started with ``--enable-memory-saver``, or releasing its
    memory frees nothing and the training runs out of memory later, far from the cause."""
    if server_info.get("device") != "cpu" and not server_info.get("enable_memory_saver"):
        raise SGLangServerError(f"{url} was started without {MEMORY_SAVER_FLAG}, which rollout.placement: colocated "
                                f"needs (its /server_info says enable_memory_saver is off): restart it with the flag")


def colocated_gpu_ranges(config: SGLangConfig, *, trainer_local_ranks: int, visible_gpus: int) -> list[range]:
    """The GPUs of each launched colocated server: from ``base_gpu_id`` (default 0, the trainer's first GPU), all of
    them GPUs a trainer rank of this node drives; :class:`ConfigError` naming the keys otherwise."""
    base = 0 if config.base_gpu_id is None else config.base_gpu_id
    ranges = server_gpu_ranges(dataclasses.replace(config, base_gpu_id=base), trainer_local_ranks=trainer_local_ranks,
                               visible_gpus=visible_gpus)
    trainer_gpus = min(trainer_local_ranks, visible_gpus)
    if ranges[-1].stop > trainer_gpus:
        raise ConfigError(
            f"rollout.placement: colocated, but rollout.sglang.num_servers ({config.num_servers}) x tp_per_server "
            f"({config.tp_per_server}) from GPU {base} reach GPU {ranges[-1].stop - 1}, and the trainer's "
            f"{trainer_local_ranks} rank(s) on this node use GPUs 0..{trainer_gpus - 1}: colocated servers must lie on "
            f"the trainer's GPUs (fewer or narrower servers, or rollout.placement: separate)")
    return ranges


def require_one_stage_per_server(config: SGLangConfig, ranges: list[range], *, ranks_per_stage: int,
                                 pipeline: int) -> None:
    """Each colocated server's GPUs must belong to one pipeline stage of the trainer, or :class:`ConfigError`.

    A server's TP ranks start only when each finds at least 0.9x the free memory of the least free one (SGLang 0.5.23
    ``distributed/bootstrap.py``, ``_check_tp_memory_balance``; on by default), and at launch every GPU holds its
    trainer rank's weights, gradients and optimizer state: the same on GPUs of one stage, different across stages
    (the first holds the embedding, the last the output layer, and their layer counts may differ). Rank 0's node
    holds global ranks 0..n-1 in order, GPU ``g`` driving rank ``g``, and megatron lays ranks out TP, then DP, then
    PP (``tp-cp-ep-dp-pp``): GPU ``g`` is in stage ``g // ranks_per_stage``, ``ranks_per_stage`` = TP x DP."""
    if pipeline <= 1:
        return
    for index, gpus in enumerate(ranges):
        stages = sorted({gpu // ranks_per_stage for gpu in gpus})
        if len(stages) > 1:
            raise ConfigError(
                f"rollout.placement: colocated, but SGLang server {index} (rollout.sglang.tp_per_server="
                f"{config.tp_per_server}) spans GPUs {gpus.start}..{gpus.stop - 1}, which hold pipeline stages "
                f"{stages[0]}..{stages[-1]} of the trainer (parallel.pipeline={pipeline}, {ranks_per_stage} GPUs a "
                f"stage): the stages' memory differs, and SGLang refuses to start TP ranks with unbalanced free "
                f"memory. Use a tp_per_server that divides {ranks_per_stage} (and a base_gpu_id that is a multiple "
                f"of it), or rollout.placement: separate")


def rank_shares_a_server_gpu(ranges: list[range], *, global_rank: int, local_rank: int, visible_gpus: int) -> bool:
    """Whether this trainer rank's GPU hosts a colocated server's TP rank. The servers run on rank 0's node, which
    holds global ranks 0..n-1 (torchrun and SLURM number ranks node by node), so a rank there has
    ``global_rank == local_rank``; its GPU is ``local_rank % visible_gpus``. Ranks elsewhere have their GPU to
    themselves and move nothing in the turns."""
    return global_rank == local_rank and any(local_rank % visible_gpus in gpus for gpus in ranges)


class ServerMemoryError(RolloutError):
    """A colocated server was asked to do something its released memory does not allow (a bug in the caller's
    order of turns, caught before the server sees it)."""


@dataclass(frozen=True)
class ServerMemory:
    """What one colocated server has released; each turn's method says which tags to move, and after the server
    confirmed, :meth:`released` / :meth:`resumed` give the new state. A fresh (or restarted) server holds it all."""

    released_tags: frozenset[str] = frozenset()

    @property
    def can_generate(self) -> bool:
        return not self.released_tags

    def after_generation(self) -> tuple[str, ...]:
        """Tags to release once a generation is over: the KV cache and CUDA graphs still held."""
        return tuple(tag for tag in GENERATION_MEMORY if tag not in self.released_tags)

    def for_training(self) -> tuple[str, ...]:
        """Tags to release before the policy update: everything still held."""
        return tuple(tag for tag in ALL_MEMORY if tag not in self.released_tags)

    def for_weight_update(self) -> tuple[str, ...]:
        """Tags to resume before new weights are pushed: the weights, when released."""
        return (WEIGHTS,) if WEIGHTS in self.released_tags else ()

    def for_generation(self) -> tuple[str, ...]:
        """Tags to resume before generating; :class:`ServerMemoryError` while the weights are released (their
        memory came back empty, or not at all: only a weight update fills it)."""
        if WEIGHTS in self.released_tags:
            raise ServerMemoryError("the server's weights were released for the policy update and no weights were "
                                    "pushed since: hand off the weights before generating")
        return tuple(tag for tag in GENERATION_MEMORY if tag in self.released_tags)

    def released(self, tags: tuple[str, ...]) -> "ServerMemory":
        return ServerMemory(self.released_tags | frozenset(tags))

    def resumed(self, tags: tuple[str, ...]) -> "ServerMemory":
        return ServerMemory(self.released_tags - frozenset(tags))
