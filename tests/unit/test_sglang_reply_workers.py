"""``rollout.sglang.reply_processes``: ``/generate`` calls and their parsing in worker processes
(dapo_megatron/rollout/sglang/reply_workers.py), against a real HTTP server in this test that answers in SGLang
0.5.23's wire format (the reply shape ``sglang_requests.streamed_samples`` parses), not a stand-in for our code.

Who sent a ``/generate`` is read by the server while the call is open: the process owning the client end of the
connection (psutil), so "runs in another process" is observed, not reported by the code under test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from functools import partial

import psutil
import pytest

from dapo_megatron.config import SGLangConfig
from dapo_megatron.rollout.engine import GenerationRequest, RolloutError, SamplingParams
from dapo_megatron.rollout.sglang.client import SGLangClient, ServerFailure, ServerReplyError
from dapo_megatron.rollout.sglang.engine import SGLangEngine
from dapo_megatron.rollout.sglang.reply_workers import ReplyWorkers
from dapo_megatron.rollout.sglang.requests import build_stream_payload, streamed_samples


def _requests(count: int) -> list[GenerationRequest]:
    params = SamplingParams(n=3, max_new_tokens=40)
    return [GenerationRequest(f"r{i}", tuple(range(i + 1, i + 6)), params) for i in range(count)]


def _engine(sglang_stub, tmp_path, reply_processes: int) -> SGLangEngine:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    config = SGLangConfig(urls=[sglang_stub.url], max_in_flight_samples=4, reply_processes=reply_processes,
                          request_timeout_s=30)
    return SGLangEngine.launch(config, model_path=model, run_dir=tmp_path / f"run{reply_processes}",
                               show_progress=False)


def _streamed(engine: SGLangEngine, requests: list[GenerationRequest]) -> dict:
    engine.submit(requests)
    finished, deadline = {}, time.monotonic() + 60
    while len(finished) < len(requests) and time.monotonic() < deadline:
        finished.update({f.request_id: f.samples for f in engine.poll(timeout_s=1.0)})
    return finished


def test_reply_processes_give_the_in_process_samples_from_processes_of_their_own(sglang_stub, tmp_path):
    requests = _requests(6)
    with _engine(sglang_stub, tmp_path, 0) as engine:
        assert engine.reply_workers is None
        in_process = _streamed(engine, requests)
        in_process_batch = engine.generate([r.prompt for r in requests], SamplingParams(n=2, max_new_tokens=9))
    assert set(sglang_stub.senders) == {os.getpid()}  # control: the sender check sees this process when it sends
    sglang_stub.senders.clear()

    engine = _engine(sglang_stub, tmp_path, 2)
    try:
        workers = engine.reply_workers.pids
        assert len(workers) == 2 and os.getpid() not in workers
        assert engine.reply_workers.threads_per_process == 2  # 4 samples in flight over 2 processes
        in_workers = _streamed(engine, requests)
        in_workers_batch = engine.generate([r.prompt for r in requests], SamplingParams(n=2, max_new_tokens=9))
        assert all(psutil.pid_exists(pid) for pid in workers)  # control for the check after shutdown
    finally:
        engine.shutdown()
    assert len(sglang_stub.senders) == 2 * len(requests) and set(sglang_stub.senders) <= set(workers)

    assert len(in_process) == len(requests) and in_workers == in_process  # lists of ints and floats, bit-equal
    sample = in_workers["r0"][0]
    assert type(sample.token_ids[0]) is int and type(sample.logprobs[0]) is float
    assert sample.token_versions == [0] * 39 + [1] and sample.weight_version == 0
    assert in_workers_batch == in_process_batch and len(in_workers_batch[0]) == 2
    assert not [pid for pid in workers if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


@pytest.fixture(scope="module")
def workers():
    pool = ReplyWorkers(1, threads_per_process=2)
    yield pool
    pool.close()


def _refused_url() -> str:
    with socket.socket() as probe:  # a port nobody listens on once the probe closes
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize("failure, expected", [
    ("http_500", ServerFailure), ("http_400", ServerReplyError), ("refused", ServerFailure),
    ("bad_logprobs", RolloutError)])
def test_a_failed_call_raises_in_rank_0_what_it_raises_in_process(sglang_stub, workers, failure, expected):
    sglang_stub.status = {"http_500": 500, "http_400": 400}.get(failure, 200)
    sglang_stub.bad_logprobs = failure == "bad_logprobs"
    client = SGLangClient(_refused_url() if failure == "refused" else sglang_stub.url, "key", 10.0)
    request = _requests(1)[0]
    payload = build_stream_payload(request, seeded=False)
    parse = partial(streamed_samples, request=request, server=client.base_url)
    with pytest.raises(RolloutError) as in_process:
        parse(client.generate(payload))
    with pytest.raises(RolloutError) as in_worker:
        workers.generate(client, payload, parse)
    assert type(in_process.value) is expected and type(in_worker.value) is expected
    assert str(in_worker.value) == str(in_process.value)


def test_a_worker_that_dies_fails_its_calls_instead_of_hanging_them(sglang_stub):
    sglang_stub.delay_s = 30.0
    pool = ReplyWorkers(1, threads_per_process=1)
    try:
        request = _requests(1)[0]
        client = SGLangClient(sglang_stub.url, None, 60.0)
        call = pool.submit(client, build_stream_payload(request, seeded=False),
                           partial(streamed_samples, request=request, server=sglang_stub.url))
        deadline = time.monotonic() + 30
        while not sglang_stub.senders and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sglang_stub.senders == pool.pids and not call.done()  # the call is in flight in the worker
        psutil.Process(pool.pids[0]).kill()
        with pytest.raises(RolloutError, match="died during the call"):
            call.result(timeout=20)
        with pytest.raises(RolloutError, match="broken"):
            pool.submit(client, {}, streamed_samples)
    finally:
        pool.close()


def test_close_leaves_no_worker_process_behind():
    pool = ReplyWorkers(2, threads_per_process=3)
    children = {child.pid for child in psutil.Process().children()}
    assert set(pool.pids) <= children and all(psutil.pid_exists(pid) for pid in pool.pids)  # control
    pool.close()
    assert not set(pool.pids) & {child.pid for child in psutil.Process().children()}
    assert [process.exitcode for process in pool.processes] == [0, 0]  # they stopped when asked, not killed
    pool.close()  # twice is fine


def test_workers_exit_when_the_trainer_dies_without_closing_them():
    script = ("from dapo_megatron.rollout.sglang.reply_workers import ReplyWorkers\n"
              "import time\nworkers = ReplyWorkers(2, threads_per_process=1)\n"
              "print(*workers.pids, flush=True)\ntime.sleep(600)\n")
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        workers = [psutil.Process(int(pid)) for pid in trainer.stdout.readline().split()]
        assert len(workers) == 2 and all(worker.is_running() for worker in workers)  # control
        trainer.kill()
        trainer.wait()
        gone, alive = psutil.wait_procs(workers, timeout=20)
        assert not alive
    finally:
        trainer.kill()
        trainer.wait()
