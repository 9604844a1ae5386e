"""Work rank 0 does for every rank (dapo_megatron.rank_zero): its result or its error reaches every rank, and a
collective stream it feeds to a consumer is read to its end on every rank even when the consumer fails part-way.

The multi-rank cases run real gloo ranks whose stream does one all-reduce per item (as the weight handoff does one
gather or send per tensor); a short collective timeout bounds a rank left waiting."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from dapo_megatron.rank_zero import Rank0Error, feed_rank0, run_on_rank0

STREAM_LENGTH = 6
BREAKS_AFTER = 2
TIMEOUT_S = 8


def _consumer_that_breaks(stream) -> None:
    for i, _ in enumerate(stream):
        if i + 1 == BREAKS_AFTER:
            raise ConnectionError("engine went away")


def _consumer_that_reads_all(stream) -> None:
    for _ in stream:
        pass


def test_single_process_stream_is_read_to_the_end_after_the_consumer_fails():
    produced = []

    def stream():
        for i in range(STREAM_LENGTH):
            produced.append(i)
            yield i

    with pytest.raises(Rank0Error, match="handoff failed on rank 0: ConnectionError: engine went away"):
        feed_rank0(stream(), _consumer_that_breaks, what="handoff")
    assert produced == list(range(STREAM_LENGTH))

    produced.clear()  # control: a consumer that succeeds raises nothing
    feed_rank0(stream(), _consumer_that_reads_all, what="handoff")
    assert produced == list(range(STREAM_LENGTH))


def test_single_process_run_on_rank0_returns_or_raises():
    assert run_on_rank0(lambda: {"a": 1}, what="x") == {"a": 1}
    with pytest.raises(Rank0Error, match="building failed on rank 0: ValueError: bad"):
        run_on_rank0(lambda: (_ for _ in ()).throw(ValueError("bad")), what="building")


# ------------------------------------------------------------------------------------------- several ranks

def _init_gloo() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _collective_stream():
    """One all-reduce per item: a rank that stops reading leaves the others blocked in the next one."""
    for i in range(STREAM_LENGTH):
        value = torch.tensor([float(i)])
        dist.all_reduce(value)
        yield value


def _outcome(action) -> dict:
    start = time.monotonic()
    try:
        action()
        error = None
    except Exception as exc:  # noqa: BLE001 - compared across ranks by the test
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - start}


def _feed_twice() -> list[dict]:
    """A consumer that fails part-way, then (the control) one that reads everything, in one process group."""
    _init_gloo()
    results = []
    for consumer in (_consumer_that_breaks, _consumer_that_reads_all):
        result = _outcome(lambda: feed_rank0(_collective_stream(), consumer, what="handoff"))
        check = torch.tensor([1.0])  # the ranks still agree afterwards: one more collective completes
        dist.all_reduce(check)
        results.append({**result, "world_after": float(check)})
    return results


def _feed_without_draining() -> dict:
    """What a handoff that only lets rank 0's consumer read the stream does: the control for the test above."""
    _init_gloo()

    def naive():
        stream = _collective_stream()
        if dist.get_rank() == 0:
            _consumer_that_breaks(stream)
        else:
            _consumer_that_reads_all(stream)

    return _outcome(naive)


def _rank0_work_twice() -> list[dict]:
    _init_gloo()
    results = []
    for fails in (False, True):
        def work():
            if fails:
                raise FileNotFoundError("no such folder")
            return {"path": "/x", "rank": dist.get_rank()}

        start = time.monotonic()
        try:
            results.append({"result": run_on_rank0(work, what="preparing"), "seconds": time.monotonic() - start})
        except Rank0Error as exc:
            results.append({"error": str(exc), "seconds": time.monotonic() - start})
    return results


def test_consumer_failure_on_rank0_reaches_every_rank_as_the_same_error():
    from spawn_ranks import run_distributed

    (broken, control), (broken_1, control_1) = run_distributed(_feed_twice, 2, timeout_s=120)
    assert {broken["error"], broken_1["error"]} == {
        "Rank0Error: handoff failed on rank 0: ConnectionError: engine went away"}
    assert broken["seconds"] < TIMEOUT_S and broken_1["seconds"] < TIMEOUT_S  # nobody waited for the timeout
    assert [control["error"], control_1["error"]] == [None, None]
    assert {r["world_after"] for r in (broken, control, broken_1, control_1)} == {2.0}


def test_without_draining_the_other_rank_is_left_waiting():
    """The control: the check above tells a drained stream from one rank 0 abandoned."""
    from spawn_ranks import run_distributed

    rank0, rank1 = run_distributed(_feed_without_draining, 2, timeout_s=120)
    assert rank0["error"] == "ConnectionError: engine went away"
    assert rank1["error"] is not None and "engine went away" not in rank1["error"], rank1


def test_run_on_rank0_result_and_error_reach_every_rank():
    from spawn_ranks import run_distributed

    (ok, failed), (ok_1, failed_1) = run_distributed(_rank0_work_twice, 2, timeout_s=120)
    assert ok["result"] == ok_1["result"] == {"path": "/x", "rank": 0}  # rank 0's result, on both ranks
    assert failed["error"] == failed_1["error"] == "preparing failed on rank 0: FileNotFoundError: no such folder"
    assert failed["seconds"] < TIMEOUT_S and failed_1["seconds"] < TIMEOUT_S


# ------------------------------------------------------------------------------------------- the waiting group

def _init_stand_in_nccl() -> None:
    """A default process group whose backend is not gloo (a registered stand-in for NCCL, which this CPU machine
    lacks), to see which backend the waiting group gets."""
    if "stand_in_nccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("stand_in_nccl", lambda store, rank, size, timeout:
                                      dist.ProcessGroupGloo(store, rank, size, timeout), devices=["cpu"])
    dist.init_process_group("stand_in_nccl", init_method=f"tcp://{os.environ['MASTER_ADDR']}:"
                            f"{os.environ['MASTER_PORT']}", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _waiting_group_backends() -> dict:
    from dapo_megatron.rank_zero import waiting_group

    _init_stand_in_nccl()
    group = waiting_group()
    assert waiting_group() is group  # made once
    return {"default": dist.get_backend(), "waiting": dist.get_backend(group),
            "a group left to the default": dist.get_backend(dist.new_group())}


def test_ranks_wait_for_rank0_in_a_gloo_group_whatever_the_default_backend():
    from spawn_ranks import run_distributed

    for backends in run_distributed(_waiting_group_backends, 2, timeout_s=120):
        assert backends == {"default": "stand_in_nccl", "waiting": "gloo",
                            "a group left to the default": "stand_in_nccl"}  # the control: not gloo by default


def _slow_rank0() -> list[dict]:
    """Rank 0 works for longer than the default group's timeout while rank 1 waits for it: through run_on_rank0, then
    (the control) the way the waiting was done before, broadcast_object_list on the default group."""
    _init_gloo()

    def work():
        time.sleep(TIMEOUT_S + 4)
        return {"groups": 3}

    start = time.monotonic()
    outcomes = [{"result": run_on_rank0(work, what="rollouts"), "seconds": time.monotonic() - start}]
    outcomes.append(_outcome(lambda: dist.broadcast_object_list([work() if dist.get_rank() == 0 else None], src=0)))
    return outcomes


@pytest.mark.slow
def test_a_rollout_longer_than_the_collective_timeout_is_waited_for():
    from spawn_ranks import run_distributed

    (waited_0, _), (waited_1, in_default_group) = run_distributed(_slow_rank0, 2, timeout_s=180)
    for outcome in (waited_0, waited_1):
        assert outcome["result"] == {"groups": 3} and outcome["seconds"] > TIMEOUT_S
    assert in_default_group["error"] is not None and "imed out" in in_default_group["error"], in_default_group


def _rank0_user_error() -> dict:
    from dapo_megatron.user_errors import DataError, UserError

    _init_gloo()

    def work():
        raise DataError("/data/train.jsonl: no such data file")

    try:
        run_on_rank0(work, what="checking the inputs")
    except UserError as exc:
        return {"type": type(exc).__name__, "is_rank0_error": isinstance(exc, Rank0Error), "kind": exc.kind,
                "exit_code": exc.exit_code, "line": exc.line()}
    return {"type": None}


def test_a_user_error_on_rank0_keeps_its_kind_on_every_rank():
    """Bad input found on rank 0 makes every rank exit with its kind's code (dapo_megatron.user_errors), its
    message unprefixed; a bug keeps the Rank0Error wording (test_run_on_rank0_result_and_error_reach_every_rank)."""
    from spawn_ranks import run_distributed

    rank0, rank1 = run_distributed(_rank0_user_error, 2, timeout_s=120)
    assert rank0 == rank1 == {"type": "Rank0UserError", "is_rank0_error": True, "kind": "data", "exit_code": 3,
                              "line": "data error: /data/train.jsonl: no such data file"}
