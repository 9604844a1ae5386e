"""Your reward (dapo_megatron/reward/): a verl reward file or module in worker processes, its three forms, timeouts
and failures that are counted and shown once, a reward service over HTTP (a real local server), the soft format
bonus and the reflection phrases."""

from __future__ import annotations

import importlib.util
import json
import logging
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.reward.format import FormatReward
from dapo_megatron.reward.function import RewardValue, reward_value
from dapo_megatron.reward.scorer import RewardRequest, RewardScorer
from dapo_megatron.rollout.engine import Sample
from dapo_megatron.run.input_checks import check_reward_function
from dapo_megatron.collectors.reflection import ReflectionPhrases
from dapo_megatron.collectors.group import score_groups
from dapo_megatron.collectors.rollout_metrics import reward_metrics

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"

# A verl reward file as verl users write them: dict with score / acc / a string and a numeric extra.
VERL_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip().endswith(ground_truth)
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": solution_str[-3:],
            "length": len(solution_str), "row": extra_info["index"]}
'''
BATCHED_FILE = '''
def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
    return [float(len(s)) for s in solution_strs]
'''
ASYNC_FILE = '''
import asyncio

async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "hang" in solution_str:
        await asyncio.sleep(3600)
    await asyncio.sleep(0.01)
    return 2.0 if ground_truth in solution_str else -2.0
'''
TROUBLE_FILE = '''
import os
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "hang" in solution_str:
        time.sleep(3600)
    if "raise" in solution_str:
        return 1 / 0
    if "exit" in solution_str:
        os._exit(3)
    if "text" in solution_str:
        return "a string"
    return 1.0
'''


def _reward_file(tmp_path, text: str, name: str = "my_reward.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return f"{path}:compute_score"


def _config(*overrides: str):
    return load_config(TINY, ["reward.num_workers=2", *overrides])


def _requests(texts: list[str], truth: str = "7") -> list[RewardRequest]:
    return [RewardRequest("src", text, truth, {"index": i}, row=f"row index={i}") for i, text in enumerate(texts)]


@pytest.fixture
def scorer_of():
    made = []

    def make(*overrides: str) -> RewardScorer:
        scorer = RewardScorer(_config(*overrides))
        made.append(scorer)
        return scorer

    yield make
    for scorer in made:
        scorer.close()


# ------------------------------------------------------------------------------------------------ answers

def test_answers_read_as_verl_defines_them():
    assert reward_value(1.0) == RewardValue(1.0, True)
    assert reward_value(0) == RewardValue(0.0, False)  # correct means > 0 without an acc
    assert reward_value({"score": -1, "acc": True, "pred": "x", "n": 3}) == RewardValue(-1.0, True, {"n": 3.0})
    assert reward_value({"score": 0.5}).acc
    for bad, message in ((None, "NoneType"), ("1", "str"), ({"acc": 1}, "without 'score'"),
                         (float("nan"), "nan"), (True, "bool")):
        with pytest.raises((TypeError, ValueError), match=message):
            reward_value(bad)


# ------------------------------------------------------------------------------------------------ forms

def test_a_verl_reward_file_scores_in_worker_processes(tmp_path, scorer_of):
    scorer = scorer_of(f"reward.function={_reward_file(tmp_path, VERL_FILE)}")
    assert "a sample at a time" in scorer.name
    (outcomes,) = scorer.score([_requests(["Answer: 7", "Answer: 8", "so 7"])])
    assert [status for status, _ in outcomes] == ["ok"] * 3
    values = [value for _, value in outcomes]
    assert [v.score for v in values] == [1.0, 0.0, 1.0] and [v.acc for v in values] == [True, False, True]
    assert values[0].extras == {"length": 9.0, "row": 0.0}  # numeric extras kept, the string "pred" not


BUILTIN_CASES = (["Answer: 7", "Answer: 8", "no answer", "Answer: \\boxed{7}", "Answer: 14/2", "Answer: 7.0"],
                 "7")


@pytest.mark.parametrize("use_math_verify", [False, True])
def test_the_builtin_rule_in_workers_scores_as_it_does_in_the_trainer(scorer_of, monkeypatch, use_math_verify):
    texts, truth = BUILTIN_CASES
    verify = f"algorithm.use_math_verify={use_math_verify}"
    in_trainer = [value for _, value in scorer_of(verify).score([_requests(texts, truth)])[0]]
    in_workers = scorer_of(verify, "reward.builtin_in_workers=true")
    assert "worker processes" in in_workers.name
    assert ("math_verify" in in_workers.name) == use_math_verify
    # Rank 0's copy of the rule breaks: the workers (spawned, their own imports) still score; the control shows
    # the default scorer does run it here.
    monkeypatch.setattr("dapo_megatron.reward.scorer.math_reward", _broken_rule)
    outcomes = in_workers.score([_requests(texts, truth)])[0]
    assert [status for status, _ in outcomes] == ["ok"] * len(texts)
    assert [value for _, value in outcomes] == in_trainer
    assert [v.acc for v in in_trainer] == [True, False, False, True, use_math_verify, use_math_verify]
    with pytest.raises(RuntimeError, match="ran in the trainer"):
        scorer_of(verify).score([_requests(texts, truth)])


def _broken_rule(*args, **kwargs):
    raise RuntimeError("the built-in rule ran in the trainer's process")


def test_builtin_in_workers_with_a_reward_of_yours_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="reward.builtin_in_workers"):
        _config(f"reward.function={_reward_file(tmp_path, VERL_FILE)}", "reward.builtin_in_workers=true")


def test_a_module_name_works_like_a_file(tmp_path, scorer_of, monkeypatch):
    (tmp_path / "pkg_rewards").mkdir()
    (tmp_path / "pkg_rewards" / "__init__.py").write_text("")
    (tmp_path / "pkg_rewards" / "math_judge.py").write_text(VERL_FILE.replace("compute_score", "judge"))
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = scorer_of("reward.function=pkg_rewards.math_judge:judge")
    (outcomes,) = scorer.score([_requests(["7", "8"])])
    assert [value.acc for _, value in outcomes] == [True, False]


def test_batched_and_async_forms(tmp_path, scorer_of):
    batched = scorer_of(f"reward.function={_reward_file(tmp_path, BATCHED_FILE, 'batched.py')}")
    assert "a group at a time" in batched.name
    outcomes = batched.score([_requests(["ab", "abcd"]), _requests(["a"])])
    assert [[value.score for _, value in group] for group in outcomes] == [[2.0, 4.0], [1.0]]
    asynchronous = scorer_of(f"reward.function={_reward_file(tmp_path, ASYNC_FILE, 'async_reward.py')}")
    assert "async" in asynchronous.name
    (outcomes,) = asynchronous.score([_requests([f"{i} 7" for i in range(20)] + ["8"])])
    assert [value.score for _, value in outcomes] == [2.0] * 20 + [-2.0]


# ------------------------------------------------------------------------------------------------ failures

def test_a_hanging_reward_times_out_and_the_pool_goes_on(tmp_path, scorer_of):
    scorer = scorer_of(f"reward.function={_reward_file(tmp_path, TROUBLE_FILE)}", "reward.timeout_s=1.5")
    started = time.monotonic()
    (outcomes,) = scorer.score([_requests(["fine", "hang", "fine", "fine"])])
    took = time.monotonic() - started
    assert [status for status, _ in outcomes] == ["ok", "timeout", "ok", "ok"]
    assert took < 30, took  # the timeout, not the hour the reward sleeps
    assert scorer.worker_restarts == 1
    (again,) = scorer.score([_requests(["fine"] * 4)])  # the replacement worker answers
    assert [status for status, _ in again] == ["ok"] * 4


def test_an_async_reward_that_hangs_times_out_inside_its_worker(tmp_path, scorer_of):
    scorer = scorer_of(f"reward.function={_reward_file(tmp_path, ASYNC_FILE, 'async_reward.py')}",
                       "reward.timeout_s=1.0")
    (outcomes,) = scorer.score([_requests(["7", "hang", "7"])])
    assert [status for status, _ in outcomes] == ["ok", "timeout", "ok"]
    assert scorer.worker_restarts == 0  # asyncio.wait_for ended it; the worker lives on


def test_errors_are_scored_counted_and_the_first_is_shown_once(tmp_path, scorer_of, caplog):
    config = _config(f"reward.function={_reward_file(tmp_path, TROUBLE_FILE)}", "reward.error_score=-5",
                     "reward.timeout_s=2", "algorithm.overlong_penalty=false")
    scorer = RewardScorer(config)
    try:
        record = PromptRecord((1, 2), "7", "math_dapo", index="row-17", text="", extra_info={"index": "row-17"})

        class Tok:
            def decode(self, ids, skip_special_tokens=True):
                return {1: "fine", 2: "raise", 3: "text", 4: "exit", 5: "hang"}[ids[0]]

        samples = [Sample(0, [token], [-0.1], "stop") for token in (1, 2, 3, 4, 5, 2)]
        with caplog.at_level(logging.ERROR, logger="dapo_megatron.reward.scorer"):
            (group,) = score_groups([(record, samples)], Tok(), config, scorer, step=0)
        assert group.scores == [1.0, -5.0, -5.0, -5.0, -5.0, -5.0]
        assert group.accs == [True, False, False, False, False, False]
        assert (group.reward_errors, group.reward_timeouts) == (4, 1)  # raise ×2, a string, a dead worker; hang
        shown = [r.getMessage() for r in caplog.records]
        assert len(shown) == 2, shown  # the first error and the first timeout, once each
        assert "my_reward.py:compute_score" in shown[0] and "row index='row-17'" in shown[0]
        assert "response 2 of 6" in shown[0] and "ZeroDivisionError" in shown[0] and "my_reward.py:" in shown[0]
        assert "timed out" in shown[1]
        metrics = reward_metrics([group])
        assert (metrics["reward/errors"], metrics["reward/timeouts"]) == (4.0, 1.0)
    finally:
        scorer.close()


@pytest.mark.parametrize("text, message", [
    ("raise RuntimeError('broken at import')\n", "RuntimeError"),  # a SyntaxError: test_reward_failures.py
    ("import not_a_module_anywhere\n", "ModuleNotFoundError"),
    ("def other(data_source, solution_str, ground_truth, extra_info): return 1\n", "has no 'compute_score'"),
    ("def compute_score(response, answer): return 1\n", "takes neither verl's per-sample arguments"),
])
def test_a_reward_that_cannot_be_used_is_a_config_error_at_start(tmp_path, text, message):
    config = _config(f"reward.function={_reward_file(tmp_path, text)}")
    with pytest.raises(ConfigError, match=message) as caught:
        check_reward_function(config)
    assert str(caught.value).startswith("reward.function:") and "my_reward.py" in str(caught.value)
    with pytest.raises(ConfigError, match=message):
        RewardScorer(config)
    with pytest.raises(ConfigError, match="no such file"):
        check_reward_function(_config(f"reward.function={tmp_path}/missing.py:compute_score"))


def test_math_verify_missing_is_a_config_error_at_start(monkeypatch):
    config = _config("algorithm.use_math_verify=true", "reward.builtin_in_workers=true")
    check_reward_function(config)  # the control: installed here (the dev extra), so nothing to refuse
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "math_verify" else real_find_spec(name, *args))
    with pytest.raises(ConfigError, match=r"algorithm.use_math_verify needs .*math-verify"):
        check_reward_function(config)


# ------------------------------------------------------------------------------------------------ HTTP service

class _RewardService(BaseHTTPRequestHandler):
    """Scores a group like BATCHED_FILE; answers 503 to the first ``failures`` requests, sleeps ``delay_s``."""

    failures = 0
    delay_s = 0.0
    requests_seen: ClassVar[list] = []  # each test's handler class gets its own list

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests_seen.append(body)
        time.sleep(self.delay_s)
        if len(self.requests_seen) <= self.failures:
            self.send_response(503)
            self.end_headers()
            return
        answer = json.dumps([{"score": float(len(s)), "acc": s.endswith(t)}
                             for s, t in zip(body["solution_strs"], body["ground_truths"])]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # the slow-service test hangs up before the answer: a broken pipe is what it asks for


@pytest.fixture
def service():
    handler = type("Handler", (_RewardService,), {"requests_seen": []})
    server = _QuietServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def test_a_reward_service_scores_a_group_per_request(service, scorer_of):
    handler, url = service
    scorer = scorer_of(f"reward.url={url}")
    outcomes = scorer.score([_requests(["ab 7", "abc"]), _requests(["7"])])
    assert [[(v.score, v.acc) for _, v in group] for group in outcomes] == [[(4.0, True), (3.0, False)], [(1.0, True)]]
    assert sorted(len(r["solution_strs"]) for r in handler.requests_seen) == [1, 2]  # batched: one POST per group
    assert handler.requests_seen[0].keys() == {"data_sources", "solution_strs", "ground_truths", "extra_infos"}


def test_a_reward_service_is_retried_within_the_bound(service, scorer_of):
    handler, url = service
    handler.failures = 2
    (outcomes,) = scorer_of(f"reward.url={url}", "reward.url_retries=2").score([_requests(["7"])])
    assert outcomes[0][0] == "ok" and len(handler.requests_seen) == 3  # two 503s, then an answer
    handler.requests_seen.clear()
    handler.failures = 100
    (outcomes,) = scorer_of(f"reward.url={url}", "reward.url_retries=1").score([_requests(["7", "8"])])
    assert [status for status, _ in outcomes] == ["error", "error"] and "HTTP 503" in outcomes[0][1]
    assert len(handler.requests_seen) == 2  # the bound: one try and one retry


def test_a_slow_reward_service_times_out(service, scorer_of):
    handler, url = service
    handler.delay_s = 3.0
    (outcomes,) = scorer_of(f"reward.url={url}", "reward.timeout_s=0.5", "reward.url_retries=0").score(
        [_requests(["7"])])
    assert outcomes[0][0] == "timeout"


# ------------------------------------------------------------------------------------------------ shaping, monitoring

def test_the_format_bonus_decays_linearly_and_never_touches_correctness():
    config = _config("reward.format.weight=0.5", "reward.format.decay_steps=10", "algorithm.overlong_penalty=false")
    bonus = FormatReward(config.reward.format)
    assert [bonus.weight(s) for s in (0, 5, 10, 20)] == [0.5, 0.25, 0.0, 0.0]
    assert bonus.matches("4+3=7\nAnswer: 7") and not bonus.matches("the answer is 7") and not bonus.matches("Answer:")
    assert not FormatReward(_config().reward.format).enabled  # off by default, as in the paper

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return {1: "Answer: 7", 2: "Answer: 8", 3: "it is 7"}[ids[0]]

    record = PromptRecord((1,), "7", "t", index=0, text="")
    samples = [Sample(0, [t], [-0.1], "stop") for t in (1, 2, 3)]
    scorer = RewardScorer(config)
    (early,) = score_groups([(record, samples)], Tok(), config, scorer, step=0)
    (late,) = score_groups([(record, samples)], Tok(), config, scorer, step=8)
    assert early.scores == [1.5, -0.5, -1.0] and late.scores == pytest.approx([1.1, -0.9, -1.0])
    assert early.accs == late.accs == [True, False, False]
    metrics = reward_metrics([late])
    assert metrics["reward/format/weight"] == pytest.approx(0.1)
    assert metrics["reward/format/match_rate"] == pytest.approx(2 / 3)


def test_reflection_phrases_are_whole_words_in_any_case():
    phrases = ReflectionPhrases(["wait", "let me check", "recheck"])
    assert phrases.found_in("so 12. Wait, that is wrong")
    assert phrases.found_in("Let me\n  check: 3+4=7")
    assert phrases.found_in("I RECHECK it")
    assert not phrases.found_in("awaiting the result; checking; rechecked")
    assert not ReflectionPhrases([]).found_in("wait")
