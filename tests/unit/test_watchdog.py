"""Issue 42.1, the watchdog of dapo_megatron/run/watchdog.py with real processes, a real TCPStore and real signals: a
rank that is SIGSTOPped is named — with its step and stage — within the timeout, a rank that keeps beating or that
left is not, a store whose host stopped is named, and the stopped rank is killed when this host sees its pid. The
whole trainer under torchrun: bench/chaos.py's short form (tests/integration/test_chaos.py)."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from torch.distributed import TCPStore

from dapo_megatron.cli import _with_where
from dapo_megatron.config import ConfigError
from dapo_megatron.launch_env import free_port
from dapo_megatron.platform import flight_recorder_env
from dapo_megatron.run.watchdog import RankActivity, Silence, Watchdog, collective_limit, kill_if_visible

TIMEOUT_S = 4.0  # ten heartbeats; a loaded 2-core machine delays a live one by far less
PEER = textwrap.dedent("""
    import datetime, sys, time
    from torch.distributed import TCPStore
    from dapo_megatron.run.watchdog import RankActivity, Watchdog
    port, host_store, timeout, *ranks = sys.argv[1:]
    def store(master=False):  # one connection per watchdog, as each rank has its own
        return TCPStore("127.0.0.1", int(port), is_master=master, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=float(timeout)))
    hosted = store(master=True) if host_store == "host" else None
    watchdogs = []
    for rank in map(int, ranks):
        left = rank < 0
        activity = RankActivity(abs(rank))
        activity.stage, activity.step = "update", 3
        dog = Watchdog(activity, store=store(), rank=abs(rank), world_size=4, timeout_s=float(timeout), run_dir=None,
                       on_silence=lambda silence: None).start()
        if left:
            time.sleep(1.0)
            dog.stop()  # this rank's run is over
        watchdogs.append(dog)
    print("beating", flush=True)
    time.sleep(600)
""")


def _peers(port: int, *ranks_of_each: tuple[int, ...], host_store: bool = False) -> list[subprocess.Popen]:
    """One process per tuple, beating for its ranks (a negative one beats a second, then leaves), started together;
    ``host_store``: the first also hosts the store, as rank 0's process does under srun."""
    # A peer's own judgement of the others (no-op here) ends its judging thread, never its heartbeat
    processes = [subprocess.Popen([sys.executable, "-c", PEER, str(port), "host" if host_store and not i else "client",
                                   str(TIMEOUT_S), *map(str, ranks)], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
                 for i, ranks in enumerate(ranks_of_each)]
    for process in processes:
        assert process.stdout.readline().strip() == "beating"
    return processes


def _watch(port: int, world_size: int = 4) -> tuple[Watchdog, list[Silence]]:
    silences: list[Silence] = []
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=TIMEOUT_S))
    dog = Watchdog(RankActivity(0), store=store, rank=0, world_size=world_size, timeout_s=TIMEOUT_S, run_dir=None,
                   store_address=f"127.0.0.1:{port}", on_silence=silences.append)
    return dog, silences


def _wait_for(silences: list, seconds: float) -> float:
    start = time.monotonic()
    while not silences and time.monotonic() - start < seconds:
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_stopped_rank_is_named_with_its_step_and_stage_and_a_live_or_departed_one_is_not(tmp_path):
    port = free_port()
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # torchrun's agent's, say
    live, stopped = _peers(port, (1, -3), (2,))
    dog, silences = _watch(port)
    try:
        with dog:
            time.sleep(1.5 * dog.interval_s)  # every rank's first beat is seen
            os.kill(stopped.pid, signal.SIGSTOP)
            waited = _wait_for(silences, 3 * TIMEOUT_S)
        assert silences, f"no silence reported within {waited:.0f} s"
        [silence] = silences
        # rank 1 beat all along and rank 3 left: only rank 2 is named, after the timeout (plus one interval)
        assert silence.rank == 2 and TIMEOUT_S <= silence.seconds <= TIMEOUT_S + 2 * dog.interval_s
        assert (silence.last.step, silence.last.stage, silence.last.pid) == (3, "update", stopped.pid)
        line = silence.line(TIMEOUT_S, detected_by=0)
        assert line.startswith(f"watchdog: rank 2 ({silence.last.host}, pid {stopped.pid}) has not been heard from "
                               f"for 4 s (parallel.collective_timeout_s=4); it was at step 3, stage update; rank 0 "
                               f"ends the job (exit 69)"), line
        # what end_job does next: the stopped rank cannot act on a SIGTERM, so this host kills it
        assert psutil.Process(stopped.pid).status() == psutil.STATUS_STOPPED
        assert kill_if_visible(silence.last)
        assert stopped.wait(timeout=30) == -signal.SIGKILL
        assert not kill_if_visible(silence.last)  # gone: its pid is not signalled again
        assert live.poll() is None
    finally:
        for process in (live, stopped):
            process.kill()
            process.wait()
        del master


def test_a_store_whose_host_stopped_is_named():
    """Under srun (and a plain launch) rank 0's process hosts the store: stopped, nothing answers the others."""
    port = free_port()
    [host] = _peers(port, (1,), host_store=True)
    dog, silences = _watch(port, world_size=2)
    try:
        with dog:
            time.sleep(1.5 * dog.interval_s)
            assert not silences
            os.kill(host.pid, signal.SIGSTOP)
            waited = _wait_for(silences, 4 * TIMEOUT_S)
            host.kill()  # the heartbeat's store call, hanging on the stopped host, ends now: leaving is quick
        assert silences, f"no silence reported within {waited:.0f} s"
        assert silences[0].rank is None and silences[0].seconds > TIMEOUT_S
        assert silences[0].line(TIMEOUT_S, 0).startswith(f"watchdog: the job's rendezvous store at 127.0.0.1:{port} "
                                                         f"(hosted by torchrun's agent, or by rank 0's process) has "
                                                         f"not been heard from for")
    finally:
        host.kill()
        host.wait()


def test_an_error_leaving_a_stage_names_where_it_happened_in_its_one_line():
    activity = RankActivity(rank=1)
    with pytest.raises(ConfigError) as raised:
        with activity.in_stage("rollout", 7):
            with activity.in_stage("checkpoint", 7):  # the innermost stage is where it happened
                raise ConfigError("trainer.run_dir: no space")
    assert (activity.stage, activity.step) == ("startup", 0)  # left as it was
    assert _with_where(raised.value.line(), raised.value) == ("config error: trainer.run_dir: no space (on rank 1 at "
                                                               "step 7, stage checkpoint)")
    assert raised.value.__notes__ == ["on rank 1 at step 7, stage checkpoint"]  # what a traceback shows
    plain = ConfigError("x: y")  # control: an error raised outside any stage keeps its line
    assert _with_where(plain.line(), plain) == "config error: x: y"
    with pytest.raises(ValueError, match="unknown stage 'warmup'"):
        with activity.in_stage("warmup"):
            pass


def test_the_collectives_wait_a_little_longer_than_the_watchdog_and_nccl_records_them():
    """A stopped rank must be named by the watchdog, not reported by gloo/NCCL as a bare timeout at the same instant
    (seen end to end before the margin); on NCCL the flight recorder dumps every rank's last collectives into the run
    directory when one times out, unless the user set those variables; nothing of it on gloo."""
    assert collective_limit(600, watched=True) == 600 + 2 * 10 + 5 and collective_limit(20, watched=True) == 29
    assert collective_limit(600, watched=False) == 600
    assert flight_recorder_env("/runs/a", "nccl", environ={}) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/a/nccl_flight_recorder/rank_"}
    mine = flight_recorder_env("/runs/a", "nccl", environ={"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"})
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in mine and len(mine) == 2
    assert flight_recorder_env("/runs/a", "gloo", environ={}) == {}
