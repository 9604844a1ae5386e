"""Issue 33.2: a reward that fails on (nearly) every response stops the run with a reward error naming the first
failure, instead of a 'successful' run that trained nothing; a dead reward service is found at start and a refused
connection is not retried like a timeout; a reward file that does not compile is a config error before any slow
import. Real worker processes, a real HTTP server and real closed ports."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from test_reward_plugin import (  # noqa: F401 - service: a fixture
    _config,
    _QuietServer,
    _requests,
    _reward_file,
    _RewardService,
    service,
)

from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.reward.scorer import JUDGED_AFTER, RewardRequest, RewardScorer
from dapo_megatron.run.input_checks import check_reward_function
from dapo_megatron.run.progress import TrainingProgress
from dapo_megatron.user_errors import EXIT_CODES, RewardError

FAILING_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "raise" in solution_str:
        return 1 / 0
    if "text" in solution_str:
        return "a string"
    return 1.0
'''


@pytest.fixture
def scorer_of(tmp_path):
    made = []

    def make(*overrides: str) -> RewardScorer:
        scorer = RewardScorer(_config(f"reward.function={_reward_file(tmp_path, FAILING_FILE)}", *overrides))
        made.append(scorer)
        return scorer

    yield make
    for scorer in made:
        scorer.close()


def _closed_port() -> int:
    with socket.socket() as probe:  # bound, never listening, then closed: connecting is refused
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("answer", ["raise", "text"], ids=["raises", "returns-a-string"])
def test_a_reward_that_fails_on_every_response_is_a_reward_error_naming_the_first_failure(scorer_of, answer):
    scorer = scorer_of()
    with pytest.raises(RewardError) as stopped:
        scorer.score([_requests([answer] * 8) for _ in range(JUDGED_AFTER // 8)])
    message = str(stopped.value)
    assert message.startswith(f"the reward failed on {JUDGED_AFTER} of {JUDGED_AFTER} responses, more than "
                              f"reward.max_error_fraction=0.5; the first failure: reward function ")
    assert "row index=0" in message and ("ZeroDivisionError" in message if answer == "raise" else "str" in message)
    assert stopped.value.exit_code == EXIT_CODES["reward"] == 8
    assert stopped.value.line().startswith("reward error: the reward failed on")


def test_small_calls_are_judged_together_and_a_rate_under_the_threshold_goes_on(scorer_of):
    scorer = scorer_of()
    for _ in range(JUDGED_AFTER // 8 - 1):  # fewer responses than a judgement needs: counted, not judged yet
        scorer.score([_requests(["raise"] * 8)])
    with pytest.raises(RewardError, match=f"failed on {JUDGED_AFTER} of {JUDGED_AFTER} responses"):
        scorer.score([_requests(["raise"] * 8)])
    # The controls: 40% failed is under the default 0.5; and 1.0 never stops
    scorer.score([_requests(["raise"] * 4 + ["7"] * 6) for _ in range(4)])
    scorer_of("reward.max_error_fraction=1.0").score([_requests(["raise"] * 8) for _ in range(8)])
    with pytest.raises(RewardError, match="more than reward.max_error_fraction=0.3"):
        scorer_of("reward.max_error_fraction=0.3").score([_requests(["raise"] * 4 + ["7"] * 6) for _ in range(4)])


HELD_OUT_FAILING_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "held-out":
        raise ValueError("this reward cannot score the held-out set")
    return 1.0
'''


def test_validation_responses_do_not_count_towards_the_error_rate(tmp_path, model_dir):
    """Issue 42.4: validation's responses were judged with training's, so a reward failing on the held-out answers
    stopped a run whose training rewards were fine. Real validation: the embedded engine's greedy answers to
    JUDGED_AFTER prompts, each scored by a reward that fails on the held-out source only."""
    from transformers import AutoTokenizer

    from dapo_megatron.data.prompts import PromptRecord
    from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
    from dapo_megatron.rollout.generator import SingleTurnGenerator
    from dapo_megatron.trainer.evaluate import evaluate

    config = _config(f"reward.function={_reward_file(tmp_path, HELD_OUT_FAILING_FILE)}", "eval.greedy=true",
                     "rollout.max_response_length=2", "algorithm.overlong_buffer_len=1", "reward.num_workers=1")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    records = [PromptRecord(prompt_ids=tuple(tokenizer.encode(f"{i}+1=")), ground_truth=str(i + 1),
                            data_source="held-out", index=i, text=f"{i}+1=") for i in range(JUDGED_AFTER)]
    engine, scorer = EmbeddedEngine.from_hf_directory(model_dir), RewardScorer(config)
    try:
        # every one failed: no reward error
        metrics = evaluate(SingleTurnGenerator(engine), records, tokenizer, config, scorer).metrics
        assert metrics["val/all/acc/mean@1"] == 0.0
        assert scorer.first_failure is None  # nor is a validation failure what a later reward error would name
        scorer.score([_requests(["7"] * 8) for _ in range(JUDGED_AFTER // 8)])  # training's own answers: fine
        held_out = [[RewardRequest("held-out", "7", "7", row=f"row index={i}")] for i in range(JUDGED_AFTER)]
        with pytest.raises(RewardError, match=f"failed on {JUDGED_AFTER} of {JUDGED_AFTER} responses"):
            scorer.score(held_out)  # control: the same failures scored for training are judged
    finally:
        scorer.close()
        engine.shutdown()


def test_a_worker_killed_between_calls_is_replaced_when_the_next_call_finds_it_gone(tmp_path):
    """Issue 42 (found by bench/chaos.py): a reward worker SIGKILLed while idle broke its pipe, and the next call sent
    to it raised BrokenPipeError out of the rollout (exit 1, a restart). Now the call goes to its replacement."""
    import os
    import signal

    from dapo_megatron.reward.pool import RewardPool

    pool = RewardPool(_reward_file(tmp_path, FAILING_FILE), num_workers=1, timeout_s=30)
    try:
        call = {"data_source": "src", "solution_str": "7", "ground_truth": "7", "extra_info": {}}
        assert pool.run([call])[0][0][0] == "ok"
        victim = pool._workers[0].process
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        [[(status, value)]] = pool.run([call])
        assert (status, value.score) == ("ok", 1.0) and pool.restarts == 1
        assert pool._workers[0].process.pid != victim.pid
    finally:
        pool.close()


def test_the_threshold_must_be_a_fraction():
    check_reward_function(_config("reward.max_error_fraction=1"))
    with pytest.raises(ConfigError, match=r"reward.max_error_fraction: must be between 0 and 1 \(1: never stop\), "
                                          r"got 1.5"):
        check_reward_function(_config("reward.max_error_fraction=1.5"))


def test_a_reward_service_that_does_not_listen_is_a_reward_error_at_start(service):  # noqa: F811
    url = f"http://127.0.0.1:{_closed_port()}/score"
    started = time.monotonic()
    with pytest.raises(RewardError, match=f"reward.url: {url} does not answer: connecting to 127.0.0.1:"
                                          f"[0-9]+ failed: .*Connection refused"):
        RewardScorer(_config(f"reward.url={url}"))
    assert time.monotonic() - started < 5
    RewardScorer(_config(f"reward.url={service[1]}")).close()  # the control: a listening service starts


def test_a_refused_connection_mid_run_fails_at_once_not_after_the_retries():
    handler = type("Handler", (_RewardService,), {"requests_seen": []})
    server = _QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    scorer = RewardScorer(_config(f"reward.url={url}", "reward.url_retries=3"))
    try:
        (outcomes,) = scorer.score([_requests(["7"])])
        assert outcomes[0][0] == "ok"  # the control: it answers
        server.shutdown()
        server.server_close()  # the service goes away after the start
        started = time.monotonic()
        (outcomes,) = scorer.score([_requests(["7", "8"])])
        took = time.monotonic() - started
        assert [status for status, _ in outcomes] == ["error", "error"]
        assert "connection refused: not retried" in outcomes[0][1]
        assert took < 1.0, f"{took:.1f} s: retried with backoff (0.5 + 1 + 2 s) as if it were a timeout"
    finally:
        scorer.close()


def test_a_reward_file_that_does_not_compile_is_a_config_error_when_the_config_loads(tmp_path):
    target = _reward_file(tmp_path, "def compute_score(data_source, solution_str,\n    return 1\n")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"reward.function: .*my_reward.py, line [12]: SyntaxError: "):
        load_config(None, ["model.hf_path=/m", "data.train_files=[a]", f"reward.function={target}"])
    assert time.monotonic() - started < 1
    good = _reward_file(tmp_path, FAILING_FILE, name="good.py")
    load_config(None, ["model.hf_path=/m", "data.train_files=[a]", f"reward.function={good}"])  # the control


def test_the_end_of_run_diagnosis_names_failed_rewards_before_the_response_length():
    config = _config()
    untrained = {"train/skipped_empty_batch": 1.0, "train/filter/all_wrong_fraction": 1.0}
    failing, short = TrainingProgress(config), TrainingProgress(config)
    for _ in range(2):
        failing.note({**untrained, "reward/errors": 30.0, "reward/timeouts": 2.0})
        short.note({**untrained, "reward/errors": 0.0, "reward/timeouts": 0.0})
    assert "the reward failed on 64 responses (reward/errors, reward/timeouts" in failing.nothing_trained()
    assert "max_response_length" not in failing.nothing_trained()
    assert "max_response_length" in short.nothing_trained()  # the control: no failure, the old diagnosis


def test_in_async_mode_the_reward_error_reaches_the_trainer_as_itself():
    """The async collector scores in its driver thread, whose errors reached the trainer as a RolloutError (a bug,
    exit 1). The control: any other failure still does."""
    from dapo_megatron.collectors.async_driver import DriverThread
    from dapo_megatron.rollout.engine import RolloutError

    for raised, expected in ((RewardError("the reward failed on 32 of 32 responses"), RewardError),
                             (ZeroDivisionError("a bug"), RolloutError)):
        def tick(raised=raised):
            raise raised

        driver = DriverThread(tick, threading.Condition(), name="test-driver")
        driver.start()
        deadline = time.monotonic() + 10
        with pytest.raises(expected):
            while time.monotonic() < deadline:  # until the thread's error is there to raise
                driver.check()
                time.sleep(0.01)
        driver.stop()
