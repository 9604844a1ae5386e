"""Steps 1–4 in async mode (``rollout.mode: async``): a driver thread on rank 0 generates while the policy trains.

The trainer's step reads as in sync mode — ``groups, metrics = collector.collect(step)`` — but here the groups were
mostly generated during the previous step(s) by the weights of then:

* **Streaming dynamic sampling.** The driver submits prompts in chunks (``algorithm.gen_batch_size``, or the batch
  size without dynamic sampling) as streamed requests (:meth:`RolloutEngine.submit`); a group is scored and
  filtered (:class:`DynamicSamplingBuffer`, the same rule as sync mode — never off unless
  ``algorithm.dynamic_sampling`` says so) as soon as its G samples are back.
* **How far ahead.** It keeps ``buffered groups + in-flight prompts × observed keep rate`` at
  ``train_batch_size × rollout.max_staleness`` (at most ``max_gen_rounds`` chunks in flight), so what it generates
  during step s is trained in steps s+1 … s+max_staleness; chunks are sized to the expected shortfall
  (:mod:`.async_pace`). ``collect(step)`` takes a batch from the buffer, waiting
  while it is short; after ``max_gen_rounds`` chunks' worth of finished groups since the last batch it trains on
  what it has (``train/hit_gen_round_cap``), as sync mode does.
* **Weight updates.** ``rollout.partial_rollouts: true``: requests in flight at an update are paused by the engine
  and continue on the new weights (per-token versions recorded). ``false``: the driver aborts them as soon as it
  sees the new version and regenerates their prompts from scratch; a response that still came back spanning two
  versions is discarded the same way.
* **Staleness bound.** The next ``collect`` trains at policy version ``N`` (the step after the last one collected;
  the trainer hands version ``N`` to the engine just before). A buffered group whose oldest token is older than
  ``N − max_staleness`` can never train: it is dropped and counted as soon as that is known, and an in-flight
  request submitted before that version (its first tokens are at least that old) is aborted and its prompt
  regenerated. Only what the next batch can use counts towards how far ahead the driver is.
  The loss then treats the remaining stale tokens per ``algorithm.rollout_correction``
  (:meth:`dapo_megatron.trainer.policy_update.PolicyUpdate.corrected`).
* **Nothing lost.** Aborted requests' prompts go back to the front of the queue. The checkpoint holds the sampler,
  the buffered groups and every prompt queued or in flight; after ``--resume`` the latter are generated again
  (``async/regenerated_prompts``). A prompt ledger (``async/ledger/*``) checks the books every step:
  drawn = trained + filtered + dropped + held (buffered, queued or in flight). Where each prompt is, the ledger and
  their checkpoint: :mod:`.async_prompts`.
* **Failures.** An engine error in the driver thread (a server lost past its restarts) is raised by the next
  ``collect`` on the trainer's thread, never a silent hang (:mod:`.async_driver`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from dapo_megatron.algorithm import DynamicSamplingBuffer, FilterStats
from dapo_megatron.config import DAPOConfig
from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.data.sampler import PromptSampler
from dapo_megatron.reward.scorer import RewardScorer
from dapo_megatron.rollout.engine import FinishedRequest, GenerationRequest, RolloutEngine
from dapo_megatron.collectors.async_driver import DriverThread
from dapo_megatron.collectors.async_pace import GenerationPace
from dapo_megatron.collectors.async_prompts import AsyncPrompts
from dapo_megatron.collectors.group import RolloutGroup, generation_seed, sampling_params, score_groups
from dapo_megatron.collectors.rollout_metrics import rollout_metrics

logger = logging.getLogger(__name__)

POLL_S = 0.05  # the driver's reaction time to finished requests and weight updates
COLLECT_CHECK_S = 1.0  # how often a waiting collect() looks at the driver thread's health


@dataclass
class _SinceLastBatch:
    """What happened between two ``collect`` calls."""

    generated: list[RolloutGroup] = field(default_factory=list)
    stats: FilterStats = field(default_factory=FilterStats)
    chunks: int = 0
    aborted_requests: int = 0
    aborted_tokens: int = 0
    dropped_groups: int = 0
    dropped_tokens: int = 0
    filtered_tokens: int = 0


class AsyncRolloutCollector:
    """Steps 1–4 from a driver thread (see the module docstring). The thread starts with the first :meth:`collect`,
    or earlier with :meth:`start`. ``reward`` as for :class:`~.sync.RolloutCollector`."""

    def __init__(self, engine: RolloutEngine, sampler: PromptSampler, tokenizer, config: DAPOConfig,
                 reward: RewardScorer):
        a, r, t = config.algorithm, config.rollout, config.trainer
        self.engine = engine
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.config = config
        self.reward = reward
        self.max_staleness = r.max_staleness
        self.pace = GenerationPace.from_config(config)
        # Surplus is the point of async mode: what does not fit this batch is the next one's (within staleness).
        self.buffer = DynamicSamplingBuffer(t.train_batch_size, surplus_policy="keep", filter_groups=a.dynamic_sampling)
        self.prompts = AsyncPrompts()
        self._since = _SinceLastBatch()
        self._next_collect: int | None = None  # the policy version of the next batch; None: the engine's
        self._cond = threading.Condition()
        self._driver = DriverThread(self._drive_once, self._cond, name="async-rollout-driver")
        if a.rollout_correction == "none":
            logger.warning("rollout.mode=async with algorithm.rollout_correction=none: tokens sampled by older weights "
                           "than the policy's are masked out of the loss (rollout_corr/masked_token_fraction); set "
                           "token_tis, seq_mis or both to importance-weight them instead")

    # ------------------------------------------------------------------------------------------------ trainer side

    def start(self) -> None:
        """Start generating (the first :meth:`collect` does it otherwise); calling it again does nothing."""
        self._driver.start()

    def collect(self, step: int) -> tuple[list[RolloutGroup], dict[str, float]]:
        """The batch of step ``step`` (the policy is at version ``step``), waiting while the buffer is short."""
        self.start()
        started = time.perf_counter()
        with self._cond:
            hit_cap = False
            while True:
                self._driver.check()
                self._evict_stale(oldest_usable=step - self.max_staleness)
                if self.buffer.is_full:
                    batch = self.buffer.pop()
                    break
                if len(self._since.generated) >= self.pace.max_in_flight:
                    batch, hit_cap = self.buffer.drain(), True
                    break
                self._cond.wait(COLLECT_CHECK_S)
            self.prompts.ledger.trained += len(batch)
            self._next_collect = step + 1
            since, self._since = self._since, _SinceLastBatch()
            metrics = rollout_metrics(batch, since.generated, since.stats, since.chunks, hit_cap,
                                      self.config.rollout.max_response_length)
            metrics.update(self._async_metrics(since, time.perf_counter() - started))
            self._cond.notify_all()
        return batch, metrics

    def _async_metrics(self, since: _SinceLastBatch, waited_s: float) -> dict[str, float]:
        prompts = self.prompts
        held = len(self.buffer) + len(prompts.queued) + prompts.num_in_flight
        metrics = {
            "async/wait_s": waited_s,
            "async/buffered_groups": float(len(self.buffer)),
            "async/in_flight_prompts": float(prompts.num_in_flight),
            "async/queued_prompts": float(len(prompts.queued)),
            "async/aborted_requests": float(since.aborted_requests),
            "async/dropped_groups": float(since.dropped_groups),
            "rollout/wasted_tokens/aborted": float(since.aborted_tokens),
            "rollout/wasted_tokens/dropped": float(since.dropped_tokens),
            "rollout/wasted_tokens/filtered": float(since.filtered_tokens),
            **prompts.ledger.metrics(held),
        }
        regenerated = prompts.take_regenerated()
        if regenerated is not None:
            metrics["async/regenerated_prompts"] = float(regenerated)
        return metrics

    def close(self) -> None:
        """Stop the driver and abort what it has in flight."""
        self._driver.stop(timeout_s=60.0)
        in_flight = self.prompts.request_ids()
        if in_flight:
            self.engine.abort(in_flight)

    def state_dict(self) -> dict:
        with self._cond:
            return {"mode": "async", "sampler": self.sampler.state_dict(), "buffer": self.buffer.state_dict(),
                    **self.prompts.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint (of either mode): its queued and in-flight prompts are generated first."""
        with self._cond:
            self.sampler.load_state_dict(state["sampler"])
            self.buffer.load_state_dict(state["buffer"])
            self.prompts.load_state_dict(state)

    # ------------------------------------------------------------------------------------------------ driver thread

    def _drive_once(self) -> None:
        """One round of the driver: evict and abort what can no longer train, submit a chunk if the next batches
        need one, take what finished."""
        with self._cond:
            version = self.engine.weight_version
            next_collect = version if self._next_collect is None else self._next_collect
            self._evict_stale(oldest_usable=next_collect - self.max_staleness)
            self._abort_unusable(version, oldest_usable=next_collect - self.max_staleness)
            requests = self._next_chunk(version)
        if requests:
            self.engine.submit(requests)
        finished = self.engine.poll(timeout_s=POLL_S)
        if finished:
            groups = self._score(finished, step=version)  # outside the lock: decoding and rewards
            with self._cond:
                for request, group in zip(finished, groups):
                    self._take_result(request, group)
                self._cond.notify_all()

    def _next_chunk(self, version: int) -> list[GenerationRequest]:
        """A chunk of prompts to submit when the buffer and what is in flight will not cover the pace's target."""
        prompts = self.prompts
        size = self.pace.next_chunk_size(buffered=len(self.buffer), live=prompts.num_live,
                                         in_flight=prompts.num_in_flight)
        if not size:
            return []
        self._since.chunks += 1
        requests = []
        for record in prompts.take(size, self.sampler):
            request_id, number = prompts.submit(record, version)
            params = sampling_params(self.config, self.tokenizer, generation_seed(self.config.trainer.seed, number, 0))
            requests.append(GenerationRequest(request_id, tuple(record.prompt_ids), params))
        return requests

    def _abort_unusable(self, version: int, oldest_usable: int) -> None:
        """Abort (and queue again) requests that can no longer make a trainable group: submitted before
        ``oldest_usable``, or — without partial rollouts — before the current version."""
        doomed = self.prompts.abort_submitted_before(oldest_usable if self.config.rollout.partial_rollouts else version)
        if doomed:
            self.engine.abort(doomed)

    def _score(self, finished: list[FinishedRequest], step: int) -> list[RolloutGroup | None]:
        """The groups of the finished requests, in one call of the reward; None for an aborted one. ``step``: the
        weight version the engine served when they were taken (the optimizer steps done)."""
        scored = [f for f in finished if not (f.aborted or self.prompts.is_aborting(f.request_id))]
        groups = score_groups([(self.prompts.record(f.request_id), f.samples) for f in scored], self.tokenizer,
                              self.config, self.reward, step)
        by_request = {f.request_id: group for f, group in zip(scored, groups)}
        return [by_request.get(f.request_id) for f in finished]

    def _take_result(self, finished: FinishedRequest, group: RolloutGroup | None) -> None:
        record = self.prompts.returned(finished.request_id)
        if group is None:  # aborted: the prompt is generated again
            self._requeue(record, finished.num_tokens)
            return
        spans = [group.response_span(i) for i in range(len(group.responses))]
        if not self.config.rollout.partial_rollouts and max(spans) > 0:
            self._requeue(record, finished.num_tokens)  # came back across an update before the abort reached it
            return
        if max(spans) > self.max_staleness:
            self._drop(1, finished.num_tokens)
            return
        self._since.generated.append(group)
        stats = self.buffer.add([group])
        self._since.stats = self._since.stats + stats
        self.pace.observe(stats.num_kept)
        if not stats.num_kept:
            self.prompts.ledger.filtered += 1
            self._since.filtered_tokens += finished.num_tokens

    def _requeue(self, record: PromptRecord, wasted_tokens: int) -> None:
        self.prompts.requeue(record)
        self._since.aborted_requests += 1
        self._since.aborted_tokens += wasted_tokens

    def _drop(self, groups: int, tokens: int) -> None:
        self.prompts.ledger.dropped += groups
        self._since.dropped_groups += groups
        self._since.dropped_tokens += tokens

    def _evict_stale(self, oldest_usable: int) -> None:
        """Drop buffered groups with a token older than ``oldest_usable``: no batch may train them any more."""
        evicted = self.buffer.remove_if(lambda g: g.weight_version < oldest_usable)
        if evicted:
            self._drop(len(evicted), sum(len(r) for g in evicted for r in g.responses))
