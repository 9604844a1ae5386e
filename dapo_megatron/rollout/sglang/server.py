"""Launching, watching and stopping one local SGLang server process (``python -m sglang.launch_server``).

How to launch it (interpreter, TP degree, host and port, startup timeout, GPUs, extra server arguments) is the run
config's ``rollout.sglang`` section (:class:`dapo_megatron.config.SGLangConfig`); ``python`` may be another
environment's interpreter (SGLang and the trainer need not share an env). The served dtype follows the trainer's
``model.precision`` (:func:`served_dtype`), not SGLang's ``auto``, which serves a float32 checkpoint in float16;
``--dtype`` in ``extra_server_args`` overrides it. GPU servers get ``--base-gpu-id`` from the pool's layout
(:mod:`dapo_megatron.rollout.sglang.gpus`) and ``--mem-fraction-static`` when the section sets it.

Each server runs in its own session (``start_new_session=True``), so it and the scheduler/detokenizer
processes it forks form one process group that :meth:`SGLangServerProcess.stop` kills as a whole (SIGTERM, a
short grace period, then SIGKILL to the group and to every descendant recorded before the kill).

Security: the server binds to ``127.0.0.1`` unless told otherwise, and always starts with an API key generated
per launch (:func:`new_api_key`). SGLang then refuses every endpoint except ``/health*``/``/ready``/
``/metrics`` without ``Authorization: Bearer <key>``, in particular ``/update_weights_*``. The key travels in a
0600 YAML file passed with ``--config``, not on the command line, so other local users cannot read it from
``ps``.

A server's environment is this process's, minus what must not reach it, passed through the platform's
``platform_environment`` (on CPU the backend adds ``SGLANG_USE_CPU_ENGINE=1`` and its ``sgl_kernel`` stand-in on
``PYTHONPATH``). CPU servers get ``--sleep-on-idle`` (otherwise the idle scheduler
spins a core) and a bounded KV cache (:data:`CPU_KV_CACHE_TOKENS`). Every server runs offline
(``HF_HUB_OFFLINE=1``): the model directory must hold the tokenizer. Per-request ``sampling_seed`` needs
``--enable-deterministic-inference`` in ``extra_server_args`` (SGLang 0.5.23: GPU attention backends only).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Callable, Literal

import psutil

from dapo_megatron.config import SGLangConfig
from dapo_megatron.platform import FLIGHT_RECORDER_FILE_ENV
from dapo_megatron.rollout.sglang.client import SGLangServerError
from dapo_megatron.rollout.sglang.gpus import NCCL_CUMEM_OFF, nccl_carries_weights

SGLANG_VERSION = "0.5.23"

ServerEnvironment = Callable[[dict[str, str]], dict[str, str]]


def unchanged_environment(environment: dict[str, str]) -> dict[str, str]:
    return environment

INSTALL_HINT = (
    f"install it into that interpreter: `scripts/install_sglang_cpu.sh PYTHON` on a CPU machine, "
    f"`PYTHON -m pip install -c constraints/gpu-sglang.txt sglang=={SGLANG_VERSION}` on a GPU machine (README, "
    f"Installation)"
)

# Environment variables of this process that must not reach a server:
# * SGLANG_RETURN_ORIGINAL_LOGPROB=1 would make returned log-probs ignore the temperature (the engine's documented
#   semantics);
# * CUDA_DEVICE_MAX_CONNECTIONS is the trainer's setting for megatron's tensor-parallel overlap
#   (dapo_megatron/platform.py), not a server's (SGLang 0.5.23 sets its own value at startup);
# * torchrun's TORCHELASTIC_* (the prefix below): with TORCHELASTIC_USE_AGENT_STORE=True, torch's tcp:// rendezvous
#   (torch/distributed/rendezvous.py, _create_c10d_store) makes every rank, rank 0 included, a client of a store it
#   expects torchrun's agent to host, so a server's own init_process_group waits for a store nobody hosts until
#   launch_timeout_s.
_ENV_REMOVED_FROM_SERVER = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "CUDA_DEVICE_MAX_CONNECTIONS")
_ENV_PREFIXES_REMOVED_FROM_SERVER = ("TORCHELASTIC_",)

# KV-cache tokens of a CPU server unless ``--max-total-tokens`` is in ``extra_server_args``: left to itself SGLang
# sizes the cache from free RAM (a 15 GB cache and a 99 s start were measured for a tiny model).
CPU_KV_CACHE_TOKENS = 16384

# Makes /release_memory_occupation and /resume_memory_occupation free and map GPU memory (colocated placement,
# dapo_megatron/rollout/placement.py); without it both answer 200 and change nothing.
MEMORY_SAVER_FLAG = "--enable-memory-saver"
# SGLang 0.5.23 allocates CUDA-graph memory inside a memory-saver region (tag "cuda_graph") only with this variable
# set (runner_backend/full_cuda_graph_backend.py; environ.py defaults it to False): without it, releasing the tag
# frees nothing and the graph pools stay on the GPU while the trainer trains.
MEMORY_SAVER_CUDA_GRAPH_ENV = "SGLANG_MEMORY_SAVER_CUDA_GRAPH"


def cuda_graphs_released(environment: dict[str, str] | os._Environ) -> bool:
    """Whether a memory-saver server started from ``environment`` puts its CUDA graphs where a release frees them:
    the server sets the variable unless the user did (SGLang reads it as a boolean)."""
    return environment.get(MEMORY_SAVER_CUDA_GRAPH_ENV, "1").strip().lower() in ("1", "true", "yes", "on")

# model.precision -> the dtype the servers compute in: FP8 training keeps BF16 weights for the handoff.
_SERVED_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}


def served_dtype(precision: str) -> str:
    """SGLang's ``--dtype`` for the trainer's ``model.precision``."""
    return _SERVED_DTYPES[precision]


def server_python(config: SGLangConfig) -> str:
    """The interpreter launched servers run: ``rollout.sglang.python``, else this one."""
    return config.python or sys.executable


def require_sglang(python: str) -> None:
    """Raise :class:`RolloutError` naming the install command when ``python`` cannot import SGLang."""
    probe = (
        "import importlib.metadata, importlib.util, sys\n"
        "if importlib.util.find_spec('sglang') is None: sys.exit(3)\n"
        "print(importlib.metadata.version('sglang'))\n"
    )
    try:
        result = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SGLangServerError(f"SGLang server python {python!r} does not exist") from None
    except subprocess.TimeoutExpired:
        raise SGLangServerError(f"SGLang server python {python!r} did not answer a version probe in 60 s") from None
    if result.returncode == 3:
        raise SGLangServerError(f"SGLang is not installed for the server python {python!r}: {INSTALL_HINT}")
    if result.returncode != 0:
        raise SGLangServerError(f"SGLang server python {python!r} failed to run: {result.stderr.strip()[-2000:]}")


def find_free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def require_free_port(host: str, port: int) -> None:
    """Raise :class:`SGLangServerError` when ``port`` is taken: a server started there cannot bind it, and the one
    already there would answer this run's health checks (and refuse its API key)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as error:
            raise SGLangServerError(
                f"port {port} on {host} is taken ({error.strerror}): another process (an SGLang server of another "
                f"run?) listens there; set rollout.sglang.base_port to a free range, or 0 for free ports") from None


def new_api_key() -> str:
    """A fresh 256-bit key in hex. Not ``token_urlsafe``: SGLang turns the config file into the argv words
    ``--api-key <key>``, and argparse takes a word starting with ``-`` for an option, so one launch in 64 died with
    "--api-key: expected one argument"."""
    return secrets.token_hex(32)


class SGLangServerProcess:
    """One ``sglang.launch_server`` process group serving ``model_path`` at ``url``, protected by ``api_key``.

    ``gpus``: the GPUs of a CUDA server (its TP ranks, consecutive); ``dtype``: SGLang's ``--dtype``;
    ``memory_saver``: start with SGLang's memory saver (a colocated server on GPUs).
    """

    def __init__(self, config: SGLangConfig, *, model_path: str | Path, index: int, run_dir: str | Path,
                 weight_version: str, device: Literal["cpu", "cuda"], gpus: range | None = None,
                 dtype: str = "auto", platform_environment: ServerEnvironment = unchanged_environment,
                 memory_saver: bool = False) -> None:
        if device == "cuda" and (gpus is None or len(gpus) != config.tp_per_server):
            raise ValueError(f"SGLang server {index}: a CUDA server needs its {config.tp_per_server} GPU(s), "
                             f"got {gpus}")
        self.config = config
        self.model_path = str(model_path)
        self.index = index
        self.run_dir = Path(run_dir)
        self.weight_version = weight_version
        self.device = device
        self.platform_environment = platform_environment
        self.gpus = gpus
        self.dtype = dtype
        self.memory_saver = memory_saver
        self.api_key = ""
        self.port = 0
        self._process: subprocess.Popen | None = None
        self._log_file = None
        self._launch_count = 0
        # /dev/shm files the running server mapped, recorded when it became ready: a server that crashed or was
        # SIGKILLed never unlinks them, so stop() does.
        self._shared_memory_files: set[str] = set()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"server{self.index}.log"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self, config_file: Path) -> list[str]:
        config = self.config
        command = [
            server_python(config), "-m", "sglang.launch_server",
            "--config", str(config_file),
            "--model-path", self.model_path,
            "--host", config.host,
            "--port", str(self.port),
            "--tp-size", str(config.tp_per_server),
            "--device", self.device,
            "--weight-version", self.weight_version,
        ]
        if not _given(config.extra_server_args, "--dtype"):
            command += ["--dtype", self.dtype]
        if config.mem_fraction_static is not None:
            command += ["--mem-fraction-static", str(config.mem_fraction_static)]
        if self.memory_saver:
            command.append(MEMORY_SAVER_FLAG)
        if self.device == "cpu":
            command.append("--sleep-on-idle")
            if not _given(config.extra_server_args, "--max-total-tokens"):
                command += ["--max-total-tokens", str(CPU_KV_CACHE_TOKENS)]
        else:
            command += ["--base-gpu-id", str(self.gpus.start)]
        return command + list(config.extra_server_args)

    def environment(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items()
               if key not in _ENV_REMOVED_FROM_SERVER and not key.startswith(_ENV_PREFIXES_REMOVED_FROM_SERVER)}
        recorder = env.get(FLIGHT_RECORDER_FILE_ENV)
        if recorder:  # the trainer's NCCL dump files: the server's TP ranks count from 0 too, so a prefix of its own
            folder, prefix = os.path.split(recorder)
            env[FLIGHT_RECORDER_FILE_ENV] = os.path.join(folder, f"server{self.index}_{prefix}")
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        if nccl_carries_weights(self.config.transport, self.device):
            env.update(NCCL_CUMEM_OFF)
        if self.memory_saver:
            env.setdefault(MEMORY_SAVER_CUDA_GRAPH_ENV, "1")
        return self.platform_environment(env)

    def start(self) -> None:
        """Start the process (returns at once; see :meth:`wait_until_ready`). A running server is stopped first."""
        self.stop()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.api_key = new_api_key()
        base_port = self.config.base_port
        self.port = base_port + self.index if base_port else find_free_port(self.config.host)
        if base_port:
            require_free_port(self.config.host, self.port)
        config_file = self.run_dir / f"server{self.index}.yaml"
        config_file.unlink(missing_ok=True)
        descriptor = os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(f'api-key: "{self.api_key}"\n')  # quoted: YAML must read it as a string
        self._launch_count += 1
        self._log_file = open(self.log_path, "a", buffering=1)
        self._log_file.write(f"\n===== launch {self._launch_count} of server {self.index}: "
                             f"{' '.join(self.command(config_file))}\n")
        self._process = subprocess.Popen(
            self.command(config_file), stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.environment(), start_new_session=True, cwd=self.run_dir,
        )

    def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Block until ``/health`` answers 200; raise :class:`RolloutError` with the log tail on exit or deadline."""
        timeout_s = self.config.launch_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.is_running():
                code = None if self._process is None else self._process.returncode
                tail = self.log_tail()
                self.stop()
                raise SGLangServerError(f"SGLang server {self.index} exited with code {code} during startup "
                                   f"(log {self.log_path}):\n{tail}")
            if self._health_ok():
                self._shared_memory_files = _mapped_shared_memory_files(_process_tree(self._process.pid))
                return
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise SGLangServerError(f"SGLang server {self.index} was not healthy after {timeout_s:.0f} s "
                                   f"(log {self.log_path}):\n{tail}")
            time.sleep(1.0)

    def _health_ok(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as handle:
                return "".join(deque(handle, maxlen=lines))
        except FileNotFoundError:
            return "(no log)"

    def stop(self, grace_s: float = 3.0) -> None:
        """Kill the server's whole process group (and any descendant that left it). Safe to call twice."""
        process, self._process = self._process, None
        if process is not None:
            _kill_process_tree(process, grace_s, self._shared_memory_files)
            self._shared_memory_files = set()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _given(arguments: list[str], flag: str) -> bool:
    """``flag`` is among ``arguments`` as ``--flag value`` or ``--flag=value``."""
    return any(argument == flag or argument.startswith(flag + "=") for argument in arguments)


def _process_tree(pid: int) -> list:
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_process_tree(process: subprocess.Popen, grace_s: float, known_shared_memory: set[str]) -> None:
    """SIGTERM the process group, wait ``grace_s``, SIGKILL the group and every recorded descendant, then unlink
    the ``/dev/shm`` files the tree maps or mapped when it became ready (SGLang's load-report segments and
    multiprocessing semaphores, which a killed server never unlinks)."""
    tree = _process_tree(process.pid)
    shared_memory_files = known_shared_memory | _mapped_shared_memory_files(tree)
    group = process.pid  # start_new_session=True: the server leads its own process group
    for sig in (signal.SIGTERM, signal.SIGCONT):  # SIGCONT: a stopped group must run to act on SIGTERM
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            break
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for member in tree[1:]:  # descendants that may have left the group
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()
    psutil.wait_procs(tree[1:], timeout=5)
    for path in shared_memory_files:
        try:
            os.unlink(path)
        except OSError:
            pass


def _mapped_shared_memory_files(processes: list) -> set[str]:
    paths: set[str] = set()
    for member in processes:
        try:
            paths.update(m.path for m in member.memory_maps(grouped=True) if m.path.startswith("/dev/shm/"))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return paths
