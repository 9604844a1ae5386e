"""What scores a response: the built-in DAPO math rule (the default: in this process, or with
``reward.builtin_in_workers`` in worker processes as :mod:`.builtin`), your function in worker processes
(:mod:`.pool`), or a reward service (:mod:`.remote`) — one of them, chosen by ``reward.function`` / ``reward.url``
— plus the soft format bonus (:mod:`.format`).

A response whose reward raises or times out is scored ``reward.error_score`` and never correct; the collectors count
them (``reward/errors``, ``reward/timeouts``). The first failure of each kind is logged once, naming the function and
the row; later ones are only counted. A reward that fails on most responses trains nothing (their groups all score
``error_score`` alike) while looking like a run: when more than ``reward.max_error_fraction`` of the responses
scored for training since the last judgement (at least :data:`JUDGED_AFTER` of them: one call, or several small ones)
failed, :meth:`RewardScorer.score` raises a :class:`~dapo_megatron.user_errors.RewardError` naming the first failure.
Validation's responses are scored unjudged (``judged=False``): a reward that fails on the held-out set's answers
neither stops the run nor hides a training failure rate above the threshold.
A reward service (``reward.url``) is connected to at start: nothing listening there is that error at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dapo_megatron.reward.rule import math_reward
from dapo_megatron.config import ConfigError, DAPOConfig
from dapo_megatron.reward import builtin
from dapo_megatron.reward.format import FormatReward
from dapo_megatron.reward.function import Outcome, RewardFunctionError, RewardValue
from dapo_megatron.reward.pool import RewardPool
from dapo_megatron.reward.remote import RemoteReward
from dapo_megatron.user_errors import RewardError

logger = logging.getLogger(__name__)

FAILURES = {"error": ("failed", "reward/errors"), "timeout": ("timed out", "reward/timeouts")}
JUDGED_AFTER = 32  # responses: fewer say little about a reward's error rate (one group of a small run)


@dataclass(frozen=True)
class RewardRequest:
    """One response to score, with what verl's reward signature passes and where it came from (for messages)."""

    data_source: str
    solution_str: str
    ground_truth: str
    extra_info: dict = field(default_factory=dict)
    row: str = ""  # e.g. "row index=17 of data source 'math_dapo', response 3 of 8"


class RewardScorer:
    """Scores groups of responses (see the module docstring); ``close`` stops its worker processes and HTTP
    threads."""

    def __init__(self, config: DAPOConfig):
        """A reward function that cannot be imported or has neither form is a :class:`ConfigError`."""
        r = config.reward
        self.use_math_verify = config.algorithm.use_math_verify
        self.format = FormatReward(r.format)
        self.error_score = r.error_score
        self._pool: RewardPool | None = None
        self._remote: RemoteReward | None = None
        self._shown: set[str] = set()
        self.max_error_fraction = r.max_error_fraction
        self.first_failure: str | None = None
        self._unjudged = [0, 0]  # responses scored, of which failed, since the last judgement
        if r.function:
            try:
                self._pool = RewardPool(r.function, num_workers=r.num_workers, timeout_s=r.timeout_s,
                                        async_concurrency=r.async_concurrency)
            except RewardFunctionError as error:
                raise ConfigError(f"reward.function: {error}") from None
            form = self._pool.form
            self.name = (f"reward function {r.function} ({'async, ' if form.is_async else ''}"
                         f"{'a group' if form.batched else 'a sample'} at a time)")
        elif r.builtin_in_workers:
            target = builtin.TARGETS[self.use_math_verify]
            self._pool = RewardPool(target, num_workers=r.num_workers, timeout_s=r.timeout_s)
            self.name = f"the built-in DAPO math rule ({target}, in {r.num_workers} worker processes)"
        elif r.url:
            self._remote = RemoteReward(r.url, timeout_s=r.timeout_s, retries=r.url_retries,
                                        concurrency=r.num_workers)
            self.name = f"reward service {r.url}"
            problem = self._remote.unreachable()
            if problem:
                self._remote.close()
                raise RewardError(f"reward.url: {r.url} does not answer: {problem}")
        else:
            self.name = "the built-in DAPO math rule"

    def score(self, groups: list[list[RewardRequest]], *, judged: bool = True) -> list[list[Outcome]]:
        """One outcome per response of each group: ``("ok", RewardValue)``, ``("error" | "timeout", message)``.
        ``judged``: whether these responses count towards ``reward.max_error_fraction`` (validation's do not)."""
        if self._pool is not None:
            outcomes = self._run_pool(groups)
        elif self._remote is not None:
            outcomes = self._remote.run([_batched_call(group) for group in groups])
        else:
            outcomes = [[self._builtin(request) for request in group] for group in groups]
        self._show_first_failures(groups, outcomes, judged=judged)
        if judged:
            self._judge(outcomes)
        return outcomes

    def value(self, outcome: Outcome) -> RewardValue:
        """The reward of an outcome: its value, or ``error_score`` (never correct) for a failure."""
        status, payload = outcome
        return payload if status == "ok" else RewardValue(self.error_score, False)

    def _builtin(self, request: RewardRequest) -> Outcome:
        result = math_reward(request.solution_str, request.ground_truth, use_math_verify=self.use_math_verify)
        return ("ok", RewardValue(result.score, result.acc))

    @property
    def worker_restarts(self) -> int:
        """Reward worker processes replaced so far (a call that timed out or crashed ends its worker); 0 without
        workers."""
        return 0 if self._pool is None else self._pool.restarts

    def _run_pool(self, groups: list[list[RewardRequest]]) -> list[list[Outcome]]:
        if self._pool.form.batched:
            return self._pool.run([_batched_call(group) for group in groups])
        flat = self._pool.run([_sample_call(request) for group in groups for request in group])
        outcomes, start = [], 0
        for group in groups:
            outcomes.append([call[0] for call in flat[start:start + len(group)]])
            start += len(group)
        return outcomes

    def _show_first_failures(self, groups: list[list[RewardRequest]], outcomes: list[list[Outcome]], *,
                             judged: bool) -> None:
        for group, group_outcomes in zip(groups, outcomes):
            for request, (status, payload) in zip(group, group_outcomes):
                if status == "ok":
                    continue
                what, counter = FAILURES[status]
                if status not in self._shown:
                    self._shown.add(status)
                    logger.error("%s %s on %s: %s (shown once; every one is counted in %s)", self.name, what,
                                 request.row, payload, counter)
                if self.first_failure is None and judged:  # what a reward error names: a training response's
                    self.first_failure = f"{self.name} {what} on {request.row}: {payload}"

    def _judge(self, outcomes: list[list[Outcome]]) -> None:
        statuses = [status for group in outcomes for status, _ in group]
        self._unjudged[0] += len(statuses)
        self._unjudged[1] += sum(status != "ok" for status in statuses)
        scored, failed = self._unjudged
        if scored < JUDGED_AFTER:
            return
        self._unjudged = [0, 0]
        if failed > self.max_error_fraction * scored:
            raise RewardError(f"the reward failed on {failed} of {scored} responses, more than "
                              f"reward.max_error_fraction={self.max_error_fraction:g}; the first failure: "
                              f"{self.first_failure}")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._remote is not None:
            self._remote.close()


def _sample_call(request: RewardRequest) -> dict:
    return {"data_source": request.data_source, "solution_str": request.solution_str,
            "ground_truth": request.ground_truth, "extra_info": request.extra_info}


def _batched_call(group: list[RewardRequest]) -> dict:
    return {"data_sources": [r.data_source for r in group], "solution_strs": [r.solution_str for r in group],
            "ground_truths": [r.ground_truth for r in group], "extra_infos": [r.extra_info for r in group]}
