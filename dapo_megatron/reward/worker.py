"""One reward worker process (started by :class:`dapo_megatron.reward.pool.RewardPool`): it imports your function
once, then answers calls from its end of a pipe until the pipe closes.

Messages: the pool sends ``(call_id, kwargs)`` (``None`` to stop); the worker answers ``("ready", None)`` or
``("load_error", message)`` once, then ``(call_id, outcomes)`` per call, where ``outcomes`` holds one
``(status, RewardValue | message)`` per response, status ``ok``, ``error`` or ``timeout``. A plain function runs one
call at a time (the pool times it out by killing the process); an ``async def`` runs up to the pool's concurrency at
once on one event loop, each under ``asyncio.wait_for`` with the call timeout.

Standard library only (and :mod:`.function`): a worker starts in well under a second plus your module's imports.
"""

from __future__ import annotations

import asyncio
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

from dapo_megatron.reward.function import (
    Outcome,
    RewardForm,
    RewardFunctionError,
    answer_outcome,
    group_outcomes,
    load_reward_function,
    reward_form,
)


def serve(conn: Connection, target: str, timeout_s: float) -> None:
    """The worker's main function."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops the pool
    try:
        function = load_reward_function(target)
        form = reward_form(function, target)
    except RewardFunctionError as error:
        conn.send(("load_error", str(error)))
        return
    conn.send(("ready", None))
    if form.is_async:
        asyncio.run(_serve_async(conn, function, form, timeout_s))
    else:
        _serve_sync(conn, function, form)


def call_size(kwargs: dict, form: RewardForm) -> int:
    """How many responses one call scores."""
    return len(kwargs["solution_strs"]) if form.batched else 1


def _serve_sync(conn: Connection, function: Callable, form: RewardForm) -> None:
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if message is None:
            return
        call_id, kwargs = message
        try:
            answer = function(**kwargs)
        except Exception as error:  # your function's, whatever it is: an outcome, not the worker's end
            conn.send((call_id, failed(error, call_size(kwargs, form))))
            continue
        conn.send((call_id, outcomes(answer, kwargs, form)))


async def _serve_async(conn: Connection, function: Callable, form: RewardForm, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    stopped = loop.create_future()
    running: set[asyncio.Task] = set()

    async def answer(call_id: int, kwargs: dict) -> None:
        size = call_size(kwargs, form)
        try:
            result = await asyncio.wait_for(function(**kwargs), timeout_s)
        except TimeoutError:  # asyncio.wait_for's, since Python 3.11
            conn.send((call_id, [("timeout", f"no answer within reward.timeout_s={timeout_s:g} s")] * size))
            return
        except Exception as error:  # as in _serve_sync
            conn.send((call_id, failed(error, size)))
            return
        conn.send((call_id, outcomes(result, kwargs, form)))

    def receive() -> None:
        try:
            message = conn.recv()
        except EOFError:
            message = None
        if message is None:
            loop.remove_reader(conn.fileno())
            if not stopped.done():
                stopped.set_result(None)
            return
        task = loop.create_task(answer(*message))
        running.add(task)
        task.add_done_callback(running.discard)

    loop.add_reader(conn.fileno(), receive)
    await stopped
    for task in running:
        task.cancel()


def outcomes(answer, kwargs: dict, form: RewardForm) -> list[Outcome]:
    """Your function's answer to one call, read response by response."""
    if not form.batched:
        return [answer_outcome(answer)]
    return group_outcomes(answer, call_size(kwargs, form), "the batched form")


def failed(error: BaseException, size: int) -> list[Outcome]:
    """An exception of your function as the outcome of each response of the call, with where it was raised."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return [("error", f"{type(error).__name__}: {error}{where}")] * size
