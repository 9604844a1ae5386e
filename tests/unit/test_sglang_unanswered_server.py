"""Issue 42: a server that stops answering in the middle of a weight handoff is waited for once, not once per call
that follows (resuming generation, checking the version: the whole request timeout each). A real HTTP server on a
real socket whose handlers stop answering while ``hung`` is set, as a SIGSTOPped SGLang server does."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dapo_megatron.rollout.sglang.client import ServerFailure, SGLangClient

TIMEOUT_S = 0.5


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        self.hung = threading.Event()
        self.released = threading.Event()
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        if self.server.hung.is_set() and self.path != "/health":
            self.server.released.wait(30)  # no answer: the client's timeout decides
        body = json.dumps({"success": True}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a late answer to a client that timed out, which is what these tests make happen

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer()

    do_GET = _answer  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    server = _Server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.released.set()
    server.shutdown()


def _timed(call) -> tuple[float, BaseException | None]:
    start = time.monotonic()
    try:
        call()
    except ServerFailure as error:
        return time.monotonic() - start, error
    return time.monotonic() - start, None


def test_after_one_unanswered_call_the_next_ones_fail_at_once_until_health_answers(server):
    client = SGLangClient(f"http://127.0.0.1:{server.server_address[1]}", "key", TIMEOUT_S)
    client.pause_generation()  # answered
    server.hung.set()
    waited, error = _timed(lambda: client.update_weights_from_tensor(["bucket"], version="3", flush_cache=True))
    assert error is not None and waited >= TIMEOUT_S * 0.9
    waited, error = _timed(client.continue_generation)
    assert error is not None and waited < TIMEOUT_S / 2, waited  # not waited for again
    assert "not sent: the server did not answer POST /update_weights_from_tensor within 0.5 s" in str(error)
    # control: a client that has not seen it hang waits the whole timeout for the same call
    fresh = SGLangClient(client.base_url, "key", TIMEOUT_S)
    waited, error = _timed(fresh.continue_generation)
    assert error is not None and waited >= TIMEOUT_S * 0.9
    # the server answers again (a stopped process continued): /health clears it
    server.hung.clear()
    server.released.set()
    assert client.healthy()
    client.continue_generation()
