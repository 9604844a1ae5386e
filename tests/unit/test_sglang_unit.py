"""Fast tests of the SGLang engine's parts that need no SGLang server (payloads, replies, buckets, snapshots,
process-group teardown, startup failures, the missing-SGLang message)."""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from dapo_megatron.backend_registry import select_backend
from dapo_megatron.config import SGLangConfig
from dapo_megatron.hf_format import bucketed
from dapo_megatron.rollout.engine import RolloutError, SamplingParams
from dapo_megatron.rollout.sglang.client import SGLangServerError
from dapo_megatron.rollout.sglang.requests import (
    build_generate_payload,
    finish_reason_from_sglang,
    per_sample_seed,
    samples_from_outputs,
)
from dapo_megatron.rollout.sglang.server import SGLangServerProcess, new_api_key, require_sglang
from dapo_megatron.rollout.sglang.transports import DiskTransport
from dapo_megatron.rollout.sglang.tensor_payloads import serialize_by_value

torch.set_num_threads(1)


# ---- payloads and replies ------------------------------------------------------------------------------------------
def test_unseeded_payload_uses_n_so_samples_share_the_prompt_prefix():
    params = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, stop_token_ids=(5, 6))
    payload = build_generate_payload([1, 2, 3], 0, params, seeded=False)
    assert payload["input_ids"] == [[1, 2, 3]]
    assert payload["return_logprob"] is True
    sampling = payload["sampling_params"]
    assert sampling["n"] == 4 and sampling["temperature"] == 0.7 and sampling["top_p"] == 0.9
    assert sampling["top_k"] == 20 and sampling["max_new_tokens"] == 12 and sampling["stop_token_ids"] == [5, 6]
    assert "sampling_seed" not in sampling


def test_seeded_payload_gives_each_sample_its_own_reproducible_seed():
    params = SamplingParams(n=3, seed=123)
    payload = build_generate_payload([7, 8], 5, params, seeded=True)
    assert payload["input_ids"] == [[7, 8]] * 3
    seeds = [p["sampling_seed"] for p in payload["sampling_params"]]
    assert len(set(seeds)) == 3, "one seed for all n copies would make them identical in SGLang's seeded sampler"
    assert all(p["n"] == 1 for p in payload["sampling_params"])
    assert seeds == [p["sampling_seed"] for p in build_generate_payload([7, 8], 5, params, seeded=True)[
        "sampling_params"]]
    assert seeds != [per_sample_seed(124, 5, j) for j in range(3)]
    assert all(0 <= seed < 2**63 for seed in seeds)
    # A seed on a server without deterministic inference falls back to one request with n.
    assert build_generate_payload([7, 8], 5, params, seeded=False)["sampling_params"]["n"] == 3


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="prompt 2 is empty"):
        build_generate_payload([], 2, SamplingParams(), seeded=False)


@pytest.mark.parametrize("sglang_reason,ours", [
    ({"type": "stop", "matched": 2}, "stop"), ({"type": "length", "length": 8}, "length"),
    ({"type": "abort", "message": "x"}, "abort"), (None, "abort"),
])
def test_finish_reasons_map_to_stop_length_abort(sglang_reason, ours):
    assert finish_reason_from_sglang({"finish_reason": sglang_reason}) == ours


def _output(ids, version="3", reason="length"):
    return {"output_ids": ids, "meta_info": {
        "weight_version": version, "finish_reason": {"type": reason},
        "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(ids)]}}


def test_replies_become_samples_with_logprobs_and_version():
    samples = samples_from_outputs([_output([4, 5]), _output([6], reason="stop")], 1, 2, 3, "srv")
    assert [s.token_ids for s in samples] == [[4, 5], [6]]
    assert samples[0].logprobs == [-0.5, -1.0]
    assert [s.finish_reason for s in samples] == ["length", "stop"]
    assert all(s.prompt_index == 1 and s.weight_version == 3 for s in samples)


def test_reply_with_another_weight_version_is_an_error():
    with pytest.raises(RolloutError, match="weight_version '2'.*pushed version 3"):
        samples_from_outputs([_output([4], version="2")], 0, 1, 3, "srv")


def test_reply_with_wrong_sample_count_or_inconsistent_logprobs_is_an_error():
    with pytest.raises(RolloutError, match="1 outputs for prompt 0, expected 2"):
        samples_from_outputs([_output([4])], 0, 2, 3, "srv")
    bad = _output([4, 5])
    bad["meta_info"]["output_token_logprobs"][1][1] = 9
    with pytest.raises(RolloutError, match="disagree"):
        samples_from_outputs([bad], 0, 1, 3, "srv")


# ---- serialization -----------------------------------------------------------------------------------------------
def test_cpu_tensors_are_serialized_by_value_not_as_shared_memory_handles():
    original = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(2, dtype=torch.bfloat16))]
    raw = base64.b64decode(serialize_by_value(original))
    assert b"rebuild_storage_fd" not in raw and b"rebuild_storage_filename" not in raw
    restored = pickle.loads(raw)
    assert [name for name, _ in restored] == ["a", "b"]
    for (_, before), (_, after) in zip(original, restored):
        assert after.dtype == before.dtype and torch.equal(after, before)


# ---- disk snapshots ----------------------------------------------------------------------------------------------
def test_disk_snapshot_is_a_complete_hf_directory(tmp_path):
    from safetensors.torch import load_file

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text('{"model_type": "qwen2"}')
    (hf_dir / "tokenizer.json").write_text("{}")
    (hf_dir / "model.safetensors").write_bytes(b"old weights, must not be copied")
    (hf_dir / "chat_template.jinja").write_text("{{ messages }}")
    (hf_dir / "notes.txt").write_text("not a side file")
    transport = DiskTransport(tmp_path / "snapshots", hf_dir)
    tensors = {f"layer{i}.weight": torch.full((4, 2), float(i)) for i in range(3)}  # 32 bytes each
    path = transport.write_snapshot(bucketed(tensors.items(), 64), version=7)  # one shard per bucket, as given
    assert path == tmp_path / "snapshots" / "v7"
    names = sorted(p.name for p in path.iterdir())
    assert names == ["chat_template.jinja", "config.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors) and index["metadata"]["total_size"] == 96
    loaded = {}
    for shard in {f for f in index["weight_map"].values()}:
        loaded.update(load_file(str(path / shard)))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())
    assert not any(p.name.startswith(".") for p in (tmp_path / "snapshots").iterdir())


def test_disk_transport_needs_a_config_dir(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        DiskTransport(tmp_path / "s", tmp_path)


# ---- server processes without SGLang -----------------------------------------------------------------------------
def _fake_python(tmp_path: Path, name: str, body: str) -> str:
    """An executable standing in for a server interpreter: runs ``body`` with the real Python, ignoring argv."""
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(body))
    wrapper = tmp_path / name
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def _server(tmp_path, config: SGLangConfig, device: str = "cpu", gpus: range | None = None) -> SGLangServerProcess:
    """A server process as the engine makes it on ``device``, in the environment the matching backend gives."""
    backend = select_backend(cuda_available=device == "cuda", transformer_engine=False)
    return SGLangServerProcess(config, model_path=tmp_path, index=0, run_dir=tmp_path / "run", weight_version="0",
                               device=device, gpus=gpus, platform_environment=backend.sglang_server_environment)


def test_missing_sglang_names_the_install_command(tmp_path):
    no_site = tmp_path / "python-without-site-packages"
    no_site.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    no_site.chmod(0o755)
    with pytest.raises(RolloutError, match="install_sglang_cpu.sh"):
        require_sglang(str(no_site))
    with pytest.raises(RolloutError, match="does not exist"):
        require_sglang(str(tmp_path / "nowhere" / "python"))


def test_server_that_exits_during_startup_reports_its_log_tail(tmp_path):
    python = _fake_python(tmp_path, "crashing", """
        print("loading model...")
        print("RuntimeError: the model is broken", flush=True)
        raise SystemExit(3)
    """)
    server = _server(tmp_path, SGLangConfig(python=python, base_port=0))
    server.start()
    with pytest.raises(RolloutError, match=r"(?s)exited with code 3.*the model is broken"):
        server.wait_until_ready(timeout_s=60)
    assert not server.is_running()
    config_file = tmp_path / "run" / "server0.yaml"
    assert stat.S_IMODE(config_file.stat().st_mode) == 0o600 and "api-key" in config_file.read_text()


@pytest.mark.sglang
def test_sglang_parses_the_launch_command_and_reads_back_the_key(tmp_path):
    """The launch command and its 0600 config file through SGLang's own argument parser (the stand-in interpreter
    runs ``prepare_server_args`` on what the server would get and stops there)."""
    from sglang_fixtures import SERVER_PYTHON

    try:
        require_sglang(SERVER_PYTHON)
    except RolloutError as error:
        pytest.skip(f"SGLang is not importable by the server python {SERVER_PYTHON}: {error}")
    probe = tmp_path / "parse_server_args.py"
    probe.write_text(textwrap.dedent("""
        import sys
        from sglang.srt.server_args import prepare_server_args
        args = prepare_server_args(sys.argv[3:])  # after "-m sglang.launch_server"
        print("parsed api key", args.api_key, flush=True)
        raise SystemExit(3)
    """))
    wrapper = tmp_path / "sglang-python"
    wrapper.write_text(f'#!/bin/sh\nexec {SERVER_PYTHON} {probe} "$@"\n')
    wrapper.chmod(0o755)
    server = _server(tmp_path, SGLangConfig(python=str(wrapper), base_port=0))
    server.start()
    with pytest.raises(RolloutError, match=r"exited with code 3"):
        server.wait_until_ready(timeout_s=120)
    assert f"parsed api key {server.api_key}\n" in server.log_tail()
    # Control: a key that starts with "-" (what token_urlsafe gave one launch in 64) is lost by SGLang's parser.
    config_file = tmp_path / "run" / "server0.yaml"
    command = server.command(config_file)
    config_file.write_text(f'api-key: "-{server.api_key}"\n')
    refused = subprocess.run([str(wrapper), *command[1:]], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--api-key: expected one argument" in refused.stderr
    assert not any(new_api_key().startswith("-") for _ in range(2000))


def test_server_that_never_gets_healthy_is_stopped_at_the_deadline(tmp_path):
    python = _fake_python(tmp_path, "silent", """
        import time
        print("still starting", flush=True)
        time.sleep(600)
    """)
    server = _server(tmp_path, SGLangConfig(python=python, base_port=0))
    server.start()
    started = time.monotonic()
    with pytest.raises(RolloutError, match=r"(?s)not healthy after 3 s.*still starting"):
        server.wait_until_ready(timeout_s=3)
    assert time.monotonic() - started < 20
    assert not server.is_running()


def test_stop_kills_the_whole_process_tree_even_when_it_ignores_sigterm(tmp_path):
    python = _fake_python(tmp_path, "stubborn", """
        import multiprocessing, os, signal, time
        def child():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(600)
        if __name__ == "__main__":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            children = [multiprocessing.get_context("spawn").Process(target=child) for _ in range(2)]
            for c in children:
                c.start()
            print("children", *[c.pid for c in children], flush=True)
            time.sleep(600)
    """)
    server = _server(tmp_path, SGLangConfig(python=python, base_port=0))
    server.start()
    deadline = time.monotonic() + 60
    while "children" not in server.log_tail() and time.monotonic() < deadline:
        time.sleep(0.2)
    line = next(row for row in server.log_tail().splitlines() if row.startswith("children"))
    pids = [server.pid] + [int(p) for p in line.split()[1:]]
    started = time.monotonic()
    server.stop(grace_s=0.5)
    assert time.monotonic() - started < 15
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    server.stop()  # idempotent


def test_cpu_servers_get_the_sgl_kernel_stand_in_and_no_logprob_override(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    server = _server(tmp_path, SGLangConfig(extra_server_args=["--max-total-tokens", "4096"]))
    env = server.environment()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in env
    stand_in_dir = env["PYTHONPATH"].split(os.pathsep)[0]
    probe = subprocess.run([sys.executable, "-c", "import sgl_kernel; sgl_kernel.verify_tree_greedy_cpu()"],
                           env={**os.environ, "PYTHONPATH": stand_in_dir}, capture_output=True, text=True)
    assert "NotImplementedError" in probe.stderr and "stand-in" in probe.stderr
    command = server.command(tmp_path / "c.yaml")
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert "--sleep-on-idle" in command and command[command.index("--max-total-tokens") + 1] == "4096"
    assert "--api-key" not in command  # the key is in the 0600 config file, not visible in `ps`


# ---- engine configuration -------------------------------------------------------------------------------------------
def test_server_command_follows_the_run_config_section(tmp_path):
    section = SGLangConfig(tp_per_server=2, python="/opt/sglang/bin/python", host="0.0.0.0", base_port=31000,
                           extra_server_args=["--schedule-policy", "lpm"])
    cpu = _server(tmp_path, section)
    cpu.port = 31000
    command = cpu.command(tmp_path / "c.yaml")
    assert command[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert command[command.index("--tp-size") + 1] == "2" and command[command.index("--host") + 1] == "0.0.0.0"
    assert command[command.index("--max-total-tokens") + 1] == "16384"  # CPU: a bounded KV cache by default
    assert command[-2:] == ["--schedule-policy", "lpm"] and command[command.index("--dtype") + 1] == "auto"
    gpu = _server(tmp_path, section, device="cuda", gpus=range(6, 8))
    command = gpu.command(tmp_path / "c.yaml")
    assert command[command.index("--base-gpu-id") + 1] == "6"  # the first of the GPUs the pool gave it
    assert "--max-total-tokens" not in command and "--sleep-on-idle" not in command
    assert _server(tmp_path, SGLangConfig()).command(tmp_path / "c.yaml")[0] == sys.executable


def test_api_key_comes_from_the_key_file(tmp_path):
    from dapo_megatron.rollout.sglang.pool import read_api_key

    key_file = tmp_path / "key"
    key_file.write_text("secret\n")
    assert read_api_key(SGLangConfig(api_key_file=str(key_file))) == "secret"
    assert read_api_key(SGLangConfig()) is None


def test_engine_rejects_a_folder_without_an_hf_config(tmp_path):
    from dapo_megatron.rollout.sglang.engine import SGLangEngine

    with pytest.raises(ValueError, match="no config.json"):
        SGLangEngine.launch(SGLangConfig(), model_path=tmp_path)


def test_a_taken_base_port_is_refused_before_the_server_starts(tmp_path):
    """A server already on base_port would answer the new server's health checks and refuse its API key (seen as an
    HTTP 401 from another run's server): the launch names the port instead, before any process starts."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        server = _server(tmp_path, SGLangConfig(base_port=taken))
        with pytest.raises(SGLangServerError, match=f"port {taken} on 127.0.0.1 is taken"):
            server.start()
        assert server.pid is None  # nothing was launched
    server = _server(tmp_path, SGLangConfig(base_port=taken, python=str(tmp_path / "missing-python")))
    with pytest.raises(Exception) as raised:  # control: the free port gets past the check, to the launch itself
        server.start()
        server.wait_until_ready(timeout_s=5)
    assert "is taken" not in str(raised.value)
    server.stop()
