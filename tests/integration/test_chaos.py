"""Issue 42: bench/chaos.py's short form in the test command — a 2-rank DAPO job under ``torchrun --max-restarts``
with ``trainer.auto_resume=true``: trainer rank 0 SIGSTOPped and a reward worker SIGKILLed at random moments, the
job's output read by nobody from the first fault on; and the same job without faults, at the same time."""

from __future__ import annotations

import json

import pytest
from chaos import TIMEOUT_S, run_short

pytestmark = pytest.mark.slow


def test_a_stopped_rank_and_a_killed_reward_worker_are_healed_without_losing_or_repeating_a_step(tmp_path):
    summary = run_short(tmp_path / "chaos")
    faulty, baseline = summary["runs"][0], summary["baselines"]["trainer"]
    assert (faulty["exit_code"], baseline["exit_code"]) == (0, 0), summary
    faults = {fault["kind"]: fault for fault in faulty["faults"]}

    # the stopped rank: the job ended (the watchdog's line, its victim killed) within the timeout plus a minute
    stop = faults["rank-stop"]
    assert stop["detected_s"] is not None and stop["detected_s"] <= TIMEOUT_S + 60, stop
    assert stop["watchdog_line"].startswith("watchdog: rank 0 (") and "; it was at step " in stop["watchdog_line"]
    assert "rank 1 ends the job (exit 69)" in stop["watchdog_line"]
    # the killed reward worker: replaced in place, no restart
    assert faults["reward-kill"]["detected_s"] is not None and faults["reward-kill"]["detected_s"] <= 60

    # one restart, resumed from the newest complete checkpoint, recorded with the fault that caused it
    run_dir = tmp_path / "chaos" / "faulty"
    [restart] = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert (restart["launcher"], restart["launcher_restart"], restart["last_fault"]["rank"]) == ("torchrun", 1, 0)
    assert restart["steps_lost"] == restart["logged_step"] - restart["resumed_step"] <= 2  # save_every=2
    assert faulty["restarts"] == 1 and faulty["steps_twice"] == 0
    # an exact resume: every step's metrics are the fault-free run's (so is the final held-out accuracy)
    assert faulty["steps_differing"] == 0 and faulty["final_step"] == baseline["final_step"] == 14
    assert faulty["accuracy"] == baseline["accuracy"]

    # nothing of either run is left running (a stopped rank's checkpoint writers were: writers_die_with_their_trainer)
    assert faulty["leftovers"] == [] and baseline["leftovers"] == [], (faulty["leftovers"], baseline["leftovers"])
    # the output's reader died at the first fault: rank 1's line (rank 0 was the one stopped) is in console.log
    console = (run_dir / "console.log").read_text()
    assert "its reader is gone" in console and stop["watchdog_line"] in console
