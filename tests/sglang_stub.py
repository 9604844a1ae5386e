"""A real HTTP server in this test process that answers ``/generate`` in SGLang 0.5.23's wire format (the reply shape
``rollout/sglang/requests.py`` parses) and records who called it and how many samples it held at once: what the
engine's transport and concurrency decisions are checked against, not a stand-in for the code under test."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest


def _output(prompt: list[int], index: int, length: int, streamed: bool) -> dict:
    """One SGLang output: tokens derived from the prompt, log-probs that are not float32 values (a lossy transfer
    would change them); a streamed one's last token sampled after a weight update (a second version span)."""
    ids = [(sum(prompt) * 31 + index * 7 + k) % 1000 for k in range(length)]
    logprobs = [-(k + 1) / (index + 3) - 1e-9 * k for k in range(length)]
    output = {"text": "", "output_ids": ids, "meta_info": {
        "output_token_logprobs": [[lp, token, None] for lp, token in zip(logprobs, ids)],
        "finish_reason": {"type": "length", "length": length}, "weight_version": "0"}}
    if streamed:
        output["meta_info"].update(weight_version="1", weight_versions=[
            {"version": "0", "start": 0, "end": length - 1}, {"version": "1", "start": length - 1, "end": length}])
    return output


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        replies = {"/health": {}, "/model_info": {"weight_version": "0"},
                   "/server_info": {"tp_size": 1, "internal_states": [
                       {"effective_max_running_requests_per_dp": self.server.capacity}]}}
        self._send(200, replies[self.path])

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        if self.path != "/generate":
            self._send(200, {"success": True})
            return
        server.senders.append(_owner_of_client_port(self.client_address[1]))
        sampling = body["sampling_params"]
        samples = sampling["n"] if isinstance(sampling, dict) else len(sampling)
        with server.lock:
            server.samples_in_flight += samples
            server.peak_samples_in_flight = max(server.peak_samples_in_flight, server.samples_in_flight)
        try:
            time.sleep(server.delay_s)
        finally:
            with server.lock:
                server.samples_in_flight -= samples
        if server.status != 200:
            self._send(server.status, {"error": {"message": "stub failure"}})
            return
        if isinstance(sampling, dict):  # one prompt, its n samples in one request (generate()'s unseeded payload)
            prompts, length = body["input_ids"] * sampling["n"], sampling["max_new_tokens"]
        else:  # one prompt copy per sample (streamed payloads)
            prompts, length = body["input_ids"], sampling[0]["max_new_tokens"]
        outputs = [_output(prompt, index, length, streamed="rid" in body) for index, prompt in enumerate(prompts)]
        if server.bad_logprobs:
            outputs[0]["meta_info"]["output_token_logprobs"][0][1] += 1
        self._send(200, outputs)


def _owner_of_client_port(port: int) -> int | None:
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            if any(c.laddr and c.laddr.port == port for c in process.net_connections(kind="tcp")):
                return process.pid
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.fixture
def sglang_stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.senders, server.status, server.delay_s, server.bad_logprobs = [], 200, 0.0, False
    server.capacity = 8  # the running-request limit its /server_info reports
    server.lock, server.samples_in_flight, server.peak_samples_in_flight = threading.Lock(), 0, 0
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
