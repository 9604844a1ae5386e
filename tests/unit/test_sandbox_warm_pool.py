"""The warm pool's bookkeeping (dapo_megatron/tools/warm_pool.py) with a start function that makes plain objects:
how many it starts ahead, that each is handed out once, what a failed start gives the call waiting for it, and
what closing ends. The pool of real sandboxes: tests/integration/test_sandbox_layers.py."""

from __future__ import annotations

import threading
import time

import pytest

from dapo_megatron.tools.warm_pool import PoolClosed, WarmPool


class Started:
    def __init__(self, number: int):
        self.number = number
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Starts:
    """A start function that counts its calls and fails where told."""

    def __init__(self, fail_at=()):
        self.made: list[Started] = []
        self.fail_at = set(fail_at)
        self.lock = threading.Lock()

    def __call__(self) -> Started:
        with self.lock:
            number = len(self.made)
            if number in self.fail_at:
                self.fail_at.discard(number)
                self.made.append(None)
                raise OSError(f"start {number} failed")
            self.made.append(Started(number))
            return self.made[-1]


def _settle(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert condition()


def test_it_keeps_size_started_and_hands_each_out_once():
    starts = Starts()
    pool = WarmPool(starts, size=3)
    try:
        _settle(lambda: pool.ready() == 3)
        time.sleep(0.05)
        assert len(starts.made) == 3, "no more than size ahead of demand"
        taken = [pool.take() for _ in range(5)]
        assert [t.number for t in taken] == [0, 1, 2, 3, 4]
        _settle(lambda: pool.ready() == 3)
        assert len(starts.made) == 8
    finally:
        for _ in taken:
            pool.finished()
        pool.close()
    assert [s.closed for s in starts.made] == [False] * 5 + [True] * 3, "close ends the waiting ones only"


def test_size_zero_starts_one_per_call_when_it_arrives():
    starts = Starts()
    pool = WarmPool(starts, size=0)
    try:
        time.sleep(0.05)
        assert starts.made == []
        assert pool.take().number == 0 and pool.take().number == 1
        time.sleep(0.05)
        assert len(starts.made) == 2 and pool.ready() == 0
    finally:
        pool.finished()
        pool.finished()
        pool.close()


def test_a_failed_start_reaches_the_waiting_call_and_the_pool_goes_on():
    starts = Starts(fail_at=[0])
    pool = WarmPool(starts, size=0)
    try:
        with pytest.raises(OSError, match="start 0 failed"):
            pool.take()
        assert pool.take().number == 1  # the next start, a retry after RETRY_S, works
    finally:
        pool.finished()
        pool.close()


def test_the_starting_thread_stays_until_every_taken_sandbox_has_ended():
    """bwrap's --die-with-parent follows the thread that started it: the pool's thread may not end under a call."""
    pool = WarmPool(Starts(), size=1)
    taken = pool.take()
    closer = threading.Thread(target=pool.close)
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive() and not taken.closed, "close waits for the call running in the taken sandbox"
    taken.close()
    pool.finished()
    closer.join(timeout=5)
    assert not closer.is_alive()


def test_a_call_waiting_when_the_pool_closes_is_refused():
    gate = threading.Event()

    def slow_start():
        gate.wait()
        return Started(0)

    pool = WarmPool(slow_start, size=0)
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(_take_or_error(pool)))
    waiter.start()
    time.sleep(0.05)
    closer = threading.Thread(target=pool.close)
    closer.start()
    waiter.join(timeout=5)
    gate.set()
    closer.join(timeout=5)
    assert outcome and isinstance(outcome[0], PoolClosed)
    with pytest.raises(PoolClosed):
        pool.take()


def _take_or_error(pool):
    try:
        return pool.take()
    except PoolClosed as error:
        return error
