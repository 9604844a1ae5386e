"""LoRA adapters served by SGLang 0.5.23 (``model.lora.handoff: adapter``): the launch flags, and which adapter each
request names.

Servers start with ``--enable-lora``, the rank and the HF modules the adapters are on (:func:`lora_server_arguments`;
starting with no adapter needs both), and serve the frozen base they load from the model folder (the first weight
handoff pushes it again, as without LoRA). After each step the trainer's adapter goes to every server with
``/load_lora_adapter_from_tensors`` under a name of its own, ``policy_v<version>`` (:func:`adapter_name`): SGLang
cannot load a name twice, and a request keeps the adapter it named until it finishes. :class:`ServedAdapters` keeps
the books:

* new requests name the newest adapter (``lora_path``) and count as in flight on it (:meth:`ServedAdapters.request`);
  every token of a request is sampled by that adapter, so its version is the adapter's, whatever the server's
  ``weight_version`` tag says meanwhile (asynchronous rollouts: a request started before a handoff finishes on the
  adapter it started with, and counts as stale by as many versions);
* an older adapter is unloaded (``/unload_lora_adapter``) once the last request naming it is back. SGLang's unload
  waits for the requests using the adapter while holding its LoRA lock, which would hold up the next load: unloading
  only adapters with nothing in flight keeps every load immediate;
* a server restarted after a failure serves the base only: :meth:`ServedAdapters.reload` loads what the others hold;
* colocated on GPUs, a server releases its weights for the policy update; it is started with a host copy of them
  (``--enable-weights-cpu-backup``), and the handoff resumes them — the base comes back — before the adapter loads
  (:meth:`~dapo_megatron.rollout.sglang.engine.SGLangEngine.update_adapter`).

Payload: ``serialized_named_tensors`` is one entry per server TP rank, each a base64 pickle of the ``{PEFT name:
tensor}`` dict (SGLang's TP workers each slice their share); ``config_dict`` is PEFT's ``adapter_config``.
"""

from __future__ import annotations

import base64
import logging
import pickle
import threading
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator, Literal, Sequence

from dapo_megatron.config.model import LoRAConfig
from dapo_megatron.hf_format.peft_adapter import PeftAdapter
from dapo_megatron.rollout.engine import RolloutError
from dapo_megatron.rollout.sglang.client import SGLangClient

logger = logging.getLogger(__name__)

# megatron's linears → the HF modules SGLang's --lora-target-modules names
HF_TARGET_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                     "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


def adapter_name(version: int) -> str:
    return f"policy_v{version}"


LORA_SLOTS = 2  # adapters a batch may mix: the newest and the one requests started before a handoff still name


def lora_server_arguments(lora: LoRAConfig, device: Literal["cpu", "cuda"], *, colocated: bool = False) -> list[str]:
    """SGLang's flags for servers that take the trainer's adapters: LoRA on, the largest rank, the HF modules, two
    adapter slots per batch (SGLang preallocates each; the default is 8); on CPU the ``torch_native`` kernels (the
    default ones are Triton's); colocated on GPUs, a host copy of the base that resuming the released weights restores
    (no full weights are pushed after the start: the handoff brings adapters alone)."""
    modules = [module for target in lora.target_modules for module in HF_TARGET_MODULES[target]]
    return ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *modules,
            "--max-loras-per-batch", str(LORA_SLOTS),
            *(["--lora-backend", "torch_native"] if device == "cpu" else []),
            *(["--enable-weights-cpu-backup"] if colocated and device == "cuda" else [])]


def adapter_payload(adapter: PeftAdapter, tp_size: int) -> list[bytes]:
    """``serialized_named_tensors``: the same base64 pickle of the tensors (host copies) for each TP rank."""
    entry = base64.b64encode(pickle.dumps({name: tensor.detach().cpu().contiguous()
                                           for name, tensor in adapter.tensors.items()},
                                          protocol=pickle.HIGHEST_PROTOCOL))
    return [entry] * tp_size


class ServedAdapters:
    """The adapters the servers hold and the requests in flight on each (see the module docstring). ``servers``
    gives the (client, TP size) of every server in rotation at the moment it is called."""

    def __init__(self, servers: Callable[[], Sequence[tuple[SGLangClient, int]]]) -> None:
        self.servers = servers
        self.current: int | None = None  # the version new requests name; None: no adapter pushed yet
        self._held: dict[int, PeftAdapter] = {}
        self._in_flight: Counter[int] = Counter()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.current is not None

    def held_versions(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def push(self, adapter: PeftAdapter, version: int) -> None:
        """Load ``adapter`` as ``policy_v<version>`` on every server, make it the one new requests name, and unload
        the older ones nothing is in flight on."""
        if self.current is not None and version <= self.current:
            raise RolloutError(f"adapter version {version} is not newer than the served {self.current}")
        for client, tp_size in self.servers():
            client.load_lora_adapter_from_tensors(adapter_name(version), adapter.config_dict(),
                                                  adapter_payload(adapter, tp_size))
        with self._lock:
            self._held[version] = adapter
            self.current = version
            idle = [held for held in self._held if held != version and not self._in_flight[held]]
        self._unload(idle)

    @contextmanager
    def request(self) -> Iterator[tuple[dict, int | None]]:
        """``(payload fields, version)`` for a request about to be sent: ``{"lora_path": name}`` and the newest
        adapter's version, which it counts as in flight until the block ends; ``({}, None)`` before any push."""
        with self._lock:
            version = self.current
            if version is not None:
                self._in_flight[version] += 1
        try:
            yield ({"lora_path": adapter_name(version)} if version is not None else {}), version
        finally:
            if version is not None:
                with self._lock:
                    self._in_flight[version] -= 1
                    idle = version != self.current and not self._in_flight[version]
                if idle:
                    self._unload([version])

    def reload(self, client: SGLangClient, tp_size: int) -> None:
        """Load every adapter still held into a server that came back without them (a restart)."""
        with self._lock:
            held = sorted(self._held.items())
        for version, adapter in held:
            client.load_lora_adapter_from_tensors(adapter_name(version), adapter.config_dict(),
                                                  adapter_payload(adapter, tp_size))

    def _unload(self, versions: Sequence[int]) -> None:
        for version in versions:
            with self._lock:
                if self._held.pop(version, None) is None:
                    continue  # another thread unloaded it
            for client, _ in self.servers():
                try:
                    client.unload_lora_adapter(adapter_name(version))
                except RolloutError as error:  # a server gone since: it holds nothing any more
                    logger.warning("unloading %s from %s failed: %s", adapter_name(version), client.base_url, error)
