"""A reward service over HTTP (``reward.url``): one POST per group, retried with a bound.

The request body is a group in verl's batched names, a JSON object of four lists of equal length::

    {"data_sources": [...], "solution_strs": [...], "ground_truths": [...], "extra_infos": [...]}

and the answer a JSON list with one score per response: a number or an object with ``score`` (and optionally
``acc`` and numeric extras), as a reward function answers (:mod:`.function`). So a batched verl reward behind a
ten-line web server is a reward service.

A request that times out (``reward.timeout_s``), fails on the way or gets HTTP 429 / 5xx is sent again, at most
``reward.url_retries`` more times, after 0.5, 1, 2 ... s (at most 8 s); a refused connection (nothing listens
there: no backoff brings it back within a step), other HTTP errors and answers that cannot be read are not retried.
:meth:`RemoteReward.unreachable` opens one connection, what the scorer does at start. A group whose request fails
for good is scored as ``timeout`` (if its last attempt timed out) or ``error``, response by response. Up to
``reward.num_workers`` requests are in flight at once.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import requests

from dapo_megatron.reward.function import Outcome, group_outcomes

RETRY_STATUS = (429, 500, 502, 503, 504)
MAX_BACKOFF_S = 8.0


class RemoteReward:
    def __init__(self, url: str, *, timeout_s: float, retries: int, concurrency: int):
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self._session = requests.Session()
        self._threads = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="dapo-reward-http")

    def run(self, calls: list[dict]) -> list[list[Outcome]]:
        """One request per call (a group in verl's batched names); the outcomes per response, in order."""
        return list(self._threads.map(self._request, calls))

    def _request(self, call: dict) -> list[Outcome]:
        size = len(call["solution_strs"])
        try:
            body = json.dumps(call)
        except (TypeError, ValueError) as error:
            return [("error", f"the group cannot be sent as JSON: {error}")] * size
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                response = self._session.post(self.url, data=body, timeout=self.timeout_s,
                                              headers={"Content-Type": "application/json"})
            except requests.Timeout:
                status, message = "timeout", f"no answer within reward.timeout_s={self.timeout_s:g} s"
                continue
            except requests.RequestException as error:
                status, message = "error", f"{type(error).__name__}: {error}"
                if _refused(error):
                    return [(status, f"{message} (connection refused: not retried)")] * size
                continue
            if response.status_code in RETRY_STATUS:
                status, message = "error", f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code != 200:
                return [("error", f"HTTP {response.status_code}: {response.text[:200]}")] * size
            return self._read(response, size)
        tries = f"{self.retries + 1} attempts"
        return [(status, f"{message} ({tries})")] * size

    @staticmethod
    def _read(response: requests.Response, size: int) -> list[Outcome]:
        try:
            answers = response.json()
        except ValueError:
            return [("error", f"the answer is not JSON: {response.text[:200]!r}")] * size
        return group_outcomes(answers, size, "the reward service")

    def unreachable(self) -> str | None:
        """Why no connection to the service opens (None when one does). A connection only: the service's answer to
        a real group is judged when there is one."""
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return "not an http(s):// URL"
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as error:
            return str(error)
        try:
            socket.create_connection((parts.hostname, port), timeout=min(self.timeout_s, 10.0)).close()
        except OSError as error:
            return f"connecting to {parts.hostname}:{port} failed: {error}"
        return None

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self._session.close()


def _refused(error: BaseException) -> bool:
    """Whether ``error`` (from requests, wrapping urllib3's) is, at its root, a refused connection."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ConnectionRefusedError):
            return True
        for arg in getattr(error, "args", ()):
            if isinstance(arg, BaseException) and _refused(arg):
                return True
        error = getattr(error, "reason", None) or error.__cause__ or error.__context__
    return False
