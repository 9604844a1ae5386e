"""The stop-signal rules of dapo_megatron/run/stop_signals.py, with real signals sent to this process (the
whole-run behaviour, with real `train` processes, is tests/integration/test_run_reliability.py)."""

from __future__ import annotations

import os
import signal

import pytest

from dapo_megatron.run.stop_signals import (
    STOPPED_EXIT_CODE,
    TERMINATED_EXIT_CODE,
    StopNow,
    StopSignals,
)


def _send(signum: int) -> None:
    os.kill(os.getpid(), signum)  # the handler runs before kill returns to the next bytecode


def test_in_the_loop_sigterm_and_sigusr1_ask_to_stop_after_the_step_and_a_second_one_stops_at_once():
    for first in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):  # SIGHUP: a closed terminal (issue 33.1)
        with StopSignals() as stop, stop.training_loop():
            assert stop.agreed_stop() is None
            _send(first)
            assert stop.agreed_stop() == first  # the step goes on; the loop stops at its end
            with pytest.raises(StopNow) as second:
                _send(signal.SIGTERM)
            assert second.value.exit_code == TERMINATED_EXIT_CODE


def test_before_the_loop_a_stop_signal_stops_at_once_with_nothing_lost():
    with StopSignals(), pytest.raises(StopNow) as stopped:
        _send(signal.SIGTERM)
    assert stopped.value.exit_code == STOPPED_EXIT_CODE


def test_a_ctrl_c_in_a_protected_section_waits_for_its_end_and_a_second_one_does_not():
    finished = []
    with StopSignals() as stop, stop.training_loop():
        with pytest.raises(KeyboardInterrupt):
            with stop.protected("finishing checkpoint 3"):
                _send(signal.SIGINT)
                finished.append("the write")  # reached: the first Ctrl-C waited
        assert finished == ["the write"]
    with StopSignals() as stop, pytest.raises(KeyboardInterrupt):
        with stop.protected("finishing checkpoint 4"):
            _send(signal.SIGINT)
            _send(signal.SIGINT)
            finished.append("never")
    assert finished == ["the write"]


def test_a_swallowed_ctrl_c_is_raised_again_at_the_end_of_the_step():
    with StopSignals() as stop, stop.training_loop():
        try:
            _send(signal.SIGINT)
        except KeyboardInterrupt:
            pass  # what a finalizer or an at-fork hook does with it
        with pytest.raises(KeyboardInterrupt):
            stop.agreed_stop()


def test_forked_children_ignore_the_signals_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals():
        child = os.fork()
        if child == 0:  # a megatron checkpoint writer, as forked from the trainer
            try:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGTERM)
            except BaseException:  # noqa: BLE001 - any escape fails the test through the exit status
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    assert signal.getsignal(signal.SIGTERM) is before
