"""One real SGLang server (CPU, fp32, a tiny random Qwen2) for the whole test session, and what tests do with it.

Starting a server takes ~40-90 s on a 2-core machine, so the modules that need one share it: ``sglang_server``
hands out a launched :class:`SGLangEngine` and launches a new one when a test shut the previous one down or left it
unhealthy. Which weights it serves is up to each test (:func:`serve`): no test relies on what another one did.

The server python is ``DAPO_SGLANG_PYTHON`` (default: this interpreter); without SGLang the tests skip with the
reason — which the full test run turns into failures (DAPO_REQUIRE_INTEGRATION, tests/conftest.py).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_qwen2, hf_greedy

from dapo_megatron.config import SGLangConfig
from dapo_megatron.rollout.engine import RolloutError, SamplingParams
from dapo_megatron.rollout.sglang.client import SGLangClient
from dapo_megatron.rollout.sglang.engine import SGLangEngine
from dapo_megatron.rollout.sglang.server import require_sglang

SERVER_PYTHON = os.environ.get("DAPO_SGLANG_PYTHON", sys.executable)
# The configured bound on one request; every legitimate request of the tests takes a few seconds.
REQUEST_TIMEOUT_S = 30.0
STARTUP_TIMEOUT_S = 400.0


@pytest.fixture(scope="session")
def sglang_model_dir(tmp_path_factory) -> Path:
    try:
        require_sglang(SERVER_PYTHON)
    except RolloutError as error:
        pytest.skip(f"SGLang is not importable by the server python {SERVER_PYTHON} (set DAPO_SGLANG_PYTHON): {error}")
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


class SharedServer:
    def __init__(self, model_dir: Path, run_root: Path):
        self.model_dir = model_dir
        self.run_root = run_root
        self.launches = 0
        self._engine: SGLangEngine | None = None

    def engine(self) -> SGLangEngine:
        """The launched engine, relaunched when it was shut down or does not answer."""
        if self._engine is not None and not self._engine.health().healthy:
            self._engine.shutdown()
            self._engine = None
        if self._engine is None:
            self.launches += 1
            # float32 for parity with transformers (SGLang's "auto" may serve an fp32 model in 16 bits)
            config = SGLangConfig(python=SERVER_PYTHON, base_port=0, launch_timeout_s=STARTUP_TIMEOUT_S,
                                  request_timeout_s=REQUEST_TIMEOUT_S, max_restarts=6,
                                  extra_server_args=["--dtype", "float32", "--max-total-tokens", "4096"])
            self._engine = SGLangEngine.launch(config, model_path=self.model_dir, show_progress=False,
                                               run_dir=self.run_root / f"launch{self.launches}")
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()


@pytest.fixture(scope="session")
def sglang_server(sglang_model_dir, tmp_path_factory):
    server = SharedServer(sglang_model_dir, tmp_path_factory.mktemp("sglang_run"))
    yield server
    server.close()


def served_version(engine: SGLangEngine) -> int:
    (server,) = engine.server_processes()
    return int(SGLangClient(server.url, server.api_key, 30).served_weight_version())


def initial_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def serve(engine: SGLangEngine, state: dict[str, torch.Tensor]) -> int:
    """Push ``state`` as the next version past whatever the server serves (another engine may have moved it)."""
    version = max(engine.weight_version, served_version(engine)) + 1
    engine.update_weights([list(state.items())], version=version)
    return version


def attached(engine: SGLangEngine, transport: str, request_timeout_s: float = REQUEST_TIMEOUT_S) -> SGLangEngine:
    """A second engine on the first one's server (no launch), pushing weights over ``transport``."""
    (server,) = engine.server_processes()
    key_file = engine.run_dir / "attached.key"
    key_file.write_text(server.api_key)
    config = SGLangConfig(urls=[server.url], api_key_file=str(key_file), transport=transport,
                          request_timeout_s=request_timeout_s)
    return SGLangEngine.launch(config, model_path=engine.model_path, show_progress=False)


def hf_greedy_until_eos(model, prompts, max_new_tokens):
    """What :func:`engine_greedy` must equal: HF's greedy continuation of each prompt, stopped at EOS like the
    server's."""
    return [hf_greedy(model, prompt, max_new_tokens, stop_at_eos=True) for prompt in prompts]


def engine_greedy(engine, prompts, max_new_tokens):
    samples = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    return [group[0].token_ids for group in samples]


def exiting_python(tmp_path: Path) -> str:
    """An interpreter stand-in for launch tests: answers SGLang's version probe, and as a "server" exits 1 at once."""
    script = tmp_path / "exit_at_once.py"
    script.write_text("import sys\nsys.exit(0 if '-c' in sys.argv else 1)\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def launched_argv(log: Path) -> list[str]:
    """The command line the launcher wrote to a server's log before starting it."""
    line = next(line for line in log.read_text().splitlines() if line.startswith("===== launch 1 of server"))
    return line.split(": ", 1)[1].split()
