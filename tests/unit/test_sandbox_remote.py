"""isolation=remote: the python tool through SandboxFusion's run_code API, against a stand-in service in the test
that speaks its format over real HTTP (the request is checked field by field, the reply is SandboxFusion's)."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dapo_megatron.tools import SandboxConfig, SandboxLimits, ToolPool, ToolsConfig


def _finished(stdout="", stderr="", code=0, status="Success", run_status="Finished"):
    return {"status": status, "message": "", "compile_result": None, "executor_pod_name": None, "files": {},
            "run_result": {"status": run_status, "execution_time": 0.01, "return_code": code, "stdout": stdout,
                           "stderr": stderr}}


class StandIn:
    """A run_code service whose reply to each request is the next of ``replies`` (a dict is sent as JSON, bytes
    as they are); it keeps the requests it got."""

    def __init__(self):
        self.replies: list = []
        self.requests: list[tuple[str, dict]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.requests.append((self.path, body))
                reply = stand_in.replies.pop(0)
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service():
    stand_in = StandIn()
    yield stand_in
    stand_in.close()


def _pool(url, **limits):
    limits = SandboxLimits(**{"wall_s": 7.0, "memory_mb": 512, **limits})
    return ToolPool(ToolsConfig(sandbox=SandboxConfig(isolation="remote", remote_url=url + "/", limits=limits)))


def test_request_fields_and_a_successful_run(service):
    service.replies.append(_finished(stdout="42\n", stderr="warning\n"))
    pool = _pool(service.url)
    try:
        result = pool.call("python", "print(6 * 7)")
    finally:
        pool.close()
    assert (result.ok, result.kind, result.text, result.exit_code) == (True, None, "42\nwarning\n", 0)
    path, body = service.requests[0]
    assert path == "/run_code"
    assert body == {"code": "print(6 * 7)", "language": "python", "run_timeout": 7.0, "memory_limit_MB": 512}
    assert pool.counts()["tools/calls"] == 1 and pool.counts()["tools/failed"] == 0


@pytest.mark.parametrize("reply, kind, needle", [
    (_finished(stderr="Traceback ...\nZeroDivisionError: division by zero\n", code=1, status="Failed"), "error",
     "ZeroDivisionError"),
    (_finished(stderr="Traceback ...\nMemoryError\n", code=1, status="Failed"), "memory", "MemoryError"),
    (_finished(stdout="partial", code=None, status="Failed", run_status="TimeLimitExceeded"), "timeout", "partial"),
    ({"status": "SandboxError", "message": "no runner for python", "run_result": None}, "crashed",
     "no runner for python"),
    (_finished(stdout="x" * 5000), "output_limit", "output limit"),
])
def test_failures_are_results_of_their_kind(service, reply, kind, needle):
    service.replies.append(reply)
    pool = _pool(service.url, output_bytes=1000)
    try:
        result = pool.call("python", "code")
    finally:
        pool.close()
    assert (result.ok, result.kind) == (False, kind)
    assert needle in result.text
    assert len(result.text) < 1100
    assert pool.counts()[f"tools/failed/{kind}"] == 1


@pytest.mark.parametrize("reply, field", [
    ({"status": "Success", "run_result": {"status": "Finished", "return_code": 0, "stderr": ""}},
     "'run_result.stdout'"),
    ({"status": "Success"}, "'run_result'"),
    ({"run_result": _finished()["run_result"]}, "'status'"),
    ({"status": "Success", "run_result": {**_finished()["run_result"], "return_code": "0"}},
     "'run_result.return_code'"),
    ({"status": "Done", "run_result": _finished()["run_result"]}, "'status' is 'Done'"),
    (b"<html>busy</html>", "not JSON"),
])
def test_a_malformed_reply_is_an_error_naming_the_field(service, reply, field):
    service.replies.append(reply)
    pool = _pool(service.url)
    try:
        result = pool.call("python", "print(1)")
    finally:
        pool.close()
    assert (result.ok, result.kind) == (False, "crashed")
    assert "reply is malformed" in result.text and field in result.text


def test_connection_refused_fails_fast():
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = _pool(f"http://127.0.0.1:{port}")
    start = time.monotonic()
    try:
        result = pool.call("python", "print(1)")
    finally:
        pool.close()
    assert time.monotonic() - start < 3.0
    assert (result.ok, result.kind) == (False, "refused")
    assert f"127.0.0.1:{port}/run_code is unreachable" in result.text
    assert pool.counts()["tools/failed/refused"] == 1
