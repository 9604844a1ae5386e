"""A small blocking HTTP client for one SGLang 0.5.23 server (stdlib only: no requests/aiohttp in the trainer env).

Every call has a timeout, so a server that stops answering surfaces as :class:`ServerFailure` after at most
that long instead of hanging the trainer; once one call got no answer in time, the client's later calls fail at once
(until ``/health`` answers again): a server stopped in the middle of a weight handoff was waited for once per call
that followed (resuming generation, checking the version), the whole timeout each. Endpoints and payloads follow
SGLang 0.5.23's ``http_server.py`` and ``io_struct.py``; weight versions are strings on the wire (the engine uses
their decimal integer form).
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dapo_megatron.rollout.engine import RolloutError
from dapo_megatron.user_errors import ServerError


HEALTH = "/health"  # answered without the API key; the one call still sent to a server that stopped answering


class SGLangServerError(RolloutError, ServerError):
    """An SGLang server is missing, failed for good, or answered something unusable (exit code of the ``server``
    kind, :mod:`dapo_megatron.user_errors`); the message names the server."""


class ServerFailure(SGLangServerError):
    """The server did not answer (connection refused/reset, no reply within the timeout) or answered 5xx."""


class ServerReplyError(SGLangServerError):
    """The server answered with an HTTP error, a reply that says the operation failed, or one that is not what the
    endpoint returns (e.g. another program listens at the URL)."""


@dataclass(frozen=True)
class StreamedJson:
    """A JSON request body sent piece by piece (never joined): ``pieces`` yields ``length`` bytes in all."""

    pieces: Sequence[bytes]
    length: int


def tensor_update_body(serialized_per_tp_rank: Sequence[str | bytes], **fields: Any) -> StreamedJson:
    """``/update_weights_from_tensor``'s body, ``{"serialized_named_tensors": [...], **fields}``, as pieces that
    reference the serialized entries instead of copying them.

    An entry is base64 (:mod:`.tensor_payloads`), which JSON carries as it is. By value, every TP
    rank's entry is the same bucket: one object repeated, so a TP-4 server's body costs no copy of the bucket where
    ``json.dumps`` + ``encode`` made eight (two per rank), and servers posted to at once share it too."""
    entries = [entry if isinstance(entry, bytes) else entry.encode("ascii") for entry in serialized_per_tp_rank]
    pieces = [b'{"serialized_named_tensors": [']
    for index, entry in enumerate(entries):
        pieces += [b', "' if index else b'"', entry, b'"']
    pieces.append(b"], " + json.dumps(fields).encode()[1:] if fields else b"]}")
    return StreamedJson(pieces, sum(len(piece) for piece in pieces))


class SGLangClient:
    """Blocking calls to one server at ``base_url`` authenticated with ``api_key`` (Bearer token)."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.unanswered: str | None = None  # the call that got no answer within its timeout, while it stands

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url})"

    # ---- transport ---------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None,
                authenticated: bool = True) -> tuple[int, Any]:
        """Send one request; return ``(status, parsed JSON or text)``; :class:`ServerFailure` if no answer.
        ``body``: anything ``json.dumps`` takes, or a :class:`StreamedJson`."""
        headers = {}
        if isinstance(body, StreamedJson):
            data: bytes | Iterator[bytes] | None = iter(body.pieces)
            headers["Content-Length"] = str(body.length)
        else:
            data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        if authenticated and self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if self.unanswered is not None and path != HEALTH:
            raise ServerFailure(f"{method} {self.base_url}{path} not sent: the server did not answer {self.unanswered}")
        request = urllib.request.Request(f"{self.base_url}{path}", data=data, headers=headers, method=method)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, _parse(response.read())
        except urllib.error.HTTPError as error:
            return error.code, _parse(error.read())
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError,
                OSError) as error:
            # socket.timeout is TimeoutError; a slow health probe is its caller's to judge
            if isinstance(getattr(error, "reason", error), TimeoutError) and path != HEALTH:
                self.unanswered = f"{method} {path} within {timeout:g} s"
            raise ServerFailure(f"{method} {self.base_url}{path} failed: {error!r}") from error

    def _call(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None) -> Any:
        status, reply = self.request(method, path, body, timeout_s=timeout_s)
        if status >= 500:
            raise ServerFailure(f"{method} {self.base_url}{path} -> HTTP {status}: {_short(reply)}")
        if status != 200 or (isinstance(reply, dict) and reply.get("success") is False):
            raise ServerReplyError(f"{method} {self.base_url}{path} -> HTTP {status}: {_short(reply)}")
        return reply

    # ---- generation ----------------------------------------------------------------------------------------------
    def generate(self, payload: dict[str, Any], *, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """``POST /generate``; always returns a list of outputs (SGLang returns a dict for a single one)."""
        reply = self._call("POST", "/generate", payload, timeout_s=timeout_s)
        outputs = reply if isinstance(reply, list) else [reply]
        if not all(isinstance(output, dict) and "output_ids" in output for output in outputs):
            raise self._unexpected("POST", "/generate", reply, "a list of outputs with output_ids")
        return outputs

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            status, _ = self.request("GET", HEALTH, timeout_s=timeout_s, authenticated=False)
        except ServerFailure:
            return False
        if status == 200:
            self.unanswered = None  # it answers again (a stopped server continued)
        return status == 200

    def model_info(self) -> dict[str, Any]:
        return self._json_object("GET", "/model_info", required="weight_version")

    def served_weight_version(self) -> str:
        return str(self.model_info()["weight_version"])

    def server_info(self) -> dict[str, Any]:
        return self._json_object("GET", "/server_info")

    def _json_object(self, method: str, path: str, *, required: str | None = None) -> dict[str, Any]:
        reply = self._call(method, path)
        if not isinstance(reply, dict) or (required is not None and required not in reply):
            raise self._unexpected(method, path, reply, "a JSON object" + (f" with {required!r}" if required else ""))
        return reply

    def _unexpected(self, method: str, path: str, reply: Any, expected: str) -> ServerReplyError:
        return ServerReplyError(f"{method} {self.base_url}{path} answered {_short(reply, 200)!r}, not {expected}: "
                                f"is an SGLang server listening there?")

    # ---- control ------------------------------------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling work until :meth:`continue_generation`. ``mode``: "abort" returns running requests as
        aborted; "retract" moves them back to the waiting queue (their KV cache is freed, so a flush and a weight
        update may follow, and recomputed by the weights served at continue); "in_place" keeps them and their KV."""
        self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", {})

    def abort_request(self, rid: str) -> None:
        """Abort the request with this ``rid`` (it returns at once with what it generated); unknown rids are
        ignored by the server."""
        self._call("POST", "/abort_request", {"rid": rid})

    def loads(self) -> list[dict[str, Any]]:
        """``GET /v1/loads``: per scheduler, ``num_running_reqs``, ``num_waiting_reqs`` and token usage."""
        reply = self._call("GET", "/v1/loads")
        return reply.get("loads", reply) if isinstance(reply, dict) else reply

    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache")

    def wait_until_idle(self, timeout_s: float) -> None:
        """Return once the scheduler is fully idle, or raise :class:`ServerReplyError` after ``timeout_s``.

        A release of memory needs SGLang 0.5.23's ``is_fully_idle()``, which also waits for the overlap scheduler's
        last batch and result queue to clear: the client has every reply one batch before that. ``/flush_cache``
        with a ``timeout`` answers only once that holds (``SchedulerFlushWrapper``), 400 when it timed out. Its side
        effect, an empty prefix cache, is what a release leaves anyway."""
        self._call("POST", f"/flush_cache?timeout={timeout_s:g}", timeout_s=timeout_s + self.timeout_s)

    def set_weight_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False})

    # ---- memory (colocated placement: dapo_megatron/rollout/placement.py) ---------------------------------------
    def release_memory_occupation(self, tags: tuple[str, ...]) -> None:
        """Free the GPU memory of these regions ("weights", "kv_cache", "cuda_graph"); the server must be idle.
        Frees something only in a server started with ``--enable-memory-saver``."""
        self._call("POST", "/release_memory_occupation", {"tags": list(tags)})

    def resume_memory_occupation(self, tags: tuple[str, ...]) -> None:
        """Map these released regions again (their old contents are gone). Resuming a region that is not released
        kills an SGLang 0.5.23 server: the caller tracks what it released."""
        self._call("POST", "/resume_memory_occupation", {"tags": list(tags)})

    # ---- weight updates -------------------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, version: str) -> None:
        self._call("POST", "/update_weights_from_disk",
                   {"model_path": model_path, "weight_version": version, "flush_cache": True})

    def begin_weight_update(self) -> None:
        self._call("POST", "/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self._call("POST", "/end_weight_update", {})

    def update_weights_from_tensor(self, serialized_per_tp_rank: Sequence[str | bytes], *, version: str | None,
                                   flush_cache: bool) -> None:
        self._call("POST", "/update_weights_from_tensor", tensor_update_body(
            serialized_per_tp_rank, weight_version=version, flush_cache=flush_cache))

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> None:
        self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        })

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, version: str | None, flush_cache: bool) -> None:
        self._call("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "weight_version": version, "flush_cache": flush_cache,
        })

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    # ---- LoRA adapters (servers started with --enable-lora; rollout/sglang/lora_adapters.py) -------------------------
    def load_lora_adapter_from_tensors(self, name: str, config: dict[str, Any],
                                       serialized_per_tp_rank: Sequence[str | bytes]) -> None:
        self._call("POST", "/load_lora_adapter_from_tensors", tensor_update_body(
            serialized_per_tp_rank, lora_name=name, config_dict=config))

    def unload_lora_adapter(self, name: str) -> None:
        self._call("POST", "/unload_lora_adapter", {"lora_name": name})


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _short(reply: Any, limit: int = 2000) -> str:
    text = reply if isinstance(reply, str) else json.dumps(reply)
    return text if len(text) <= limit else text[:limit] + "..."
