"""slurm/launch_plan.py: node split, ports, URLs, the server exec and the health wait (fast; no cluster needed)."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH_PLAN = REPO / "slurm" / "launch_plan.py"


def _load_launch_plan():
    spec = importlib.util.spec_from_file_location("launch_plan", LAUNCH_PLAN)
    module = importlib.util.module_from_spec(spec)
    sys.modules["launch_plan"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


lp = _load_launch_plan()
HOSTS16 = [f"node{i:02d}" for i in range(1, 17)]


def _shell_values(plan) -> dict[str, str]:
    """What the sbatch scripts see after ``eval``: run the assignments in a real shell."""
    script = plan.shell_assignments() + \
        'for k in SERVER_URLS TRAINER_NODES MASTER_ADDR; do printf "%s\\0" "${!k}"; done'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    return dict(zip(["SERVER_URLS", "TRAINER_NODES", "MASTER_ADDR"], out.split("\0")))


def test_proposed_32b_layout_16_nodes():
    """README layout: 4 nodes × 2 servers (TP 4) serve, 12 nodes × 8 GPUs train."""
    plan = lp.make_plan(HOSTS16, sglang_nodes=4, gpus_per_node=8, tasks_per_node=8, job_id=123456, server_tp=4)
    assert plan.server_hosts == HOSTS16[:4]
    assert plan.trainer_hosts == HOSTS16[4:]
    assert plan.servers_per_node == 2
    assert plan.trainer_tasks_per_node == 8 and plan.trainer_world_size == 96
    assert plan.master_addr == "node05"
    assert plan.master_port == 20000 + 123456 % 10000
    base = plan.server_base_port
    assert plan.server_urls == [f"http://node{n:02d}:{base + i}" for n in range(1, 5) for i in range(2)]
    assert plan.trainer_cuda_visible_devices == ""
    values = _shell_values(plan)
    assert json.loads(values["SERVER_URLS"]) == plan.server_urls
    assert values["TRAINER_NODES"] == ",".join(HOSTS16[4:])
    assert values["MASTER_ADDR"] == "node05"


def test_no_servers_all_nodes_train():
    plan = lp.make_plan(["a", "b"], sglang_nodes=0, gpus_per_node=8, tasks_per_node=8, job_id=5)
    assert plan.server_urls == [] and plan.trainer_hosts == ["a", "b"] and plan.trainer_world_size == 16
    assert plan.master_addr == "a"


def test_cpu_nodes_use_tasks_per_node():
    plan = lp.make_plan(["a", "b", "c"], sglang_nodes=1, gpus_per_node=0, tasks_per_node=4, job_id=5)
    assert plan.servers_per_node == 1 and plan.trainer_tasks_per_node == 4 and plan.trainer_world_size == 8


def test_single_node_splits_gpus():
    plan = lp.make_plan(["box"], sglang_nodes=1, gpus_per_node=8, tasks_per_node=8, job_id=5, server_tp=2)
    assert plan.server_hosts == ["box"] and plan.trainer_hosts == ["box"]
    assert plan.servers_per_node == 1
    assert plan.trainer_tasks_per_node == 6
    assert plan.trainer_cuda_visible_devices == "2,3,4,5,6,7"


def test_single_cpu_node_shares_it():
    plan = lp.make_plan(["vm"], sglang_nodes=1, gpus_per_node=0, tasks_per_node=2, job_id=5)
    assert plan.server_urls == [f"http://vm:{plan.server_base_port}"]
    assert plan.trainer_tasks_per_node == 2 and plan.trainer_cuda_visible_devices == ""


def test_nodes_are_reached_at_their_node_addr_and_placed_by_name():
    """URLs and MASTER_ADDR must reach the node where its name does not resolve; srun places tasks by name."""
    addrs = {"n1": "10.77.0.1", "n2": "10.77.0.2", "n3": "10.77.0.3"}
    plan = lp.make_plan(["n1", "n2", "n3"], sglang_nodes=1, gpus_per_node=0, tasks_per_node=1, job_id=7,
                        node_addrs=addrs)
    assert plan.server_urls == [f"http://10.77.0.1:{plan.server_base_port}"]
    assert plan.master_addr == "10.77.0.2"
    values = _shell_values(plan)
    assert values["TRAINER_NODES"] == "n2,n3" and values["MASTER_ADDR"] == "10.77.0.2"
    trainer_only = lp.make_plan(["n1", "n2"], sglang_nodes=0, gpus_per_node=0, tasks_per_node=1, job_id=7,
                                node_addrs=addrs)
    assert trainer_only.master_addr == "10.77.0.1"


def test_node_addresses_need_scontrol(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(lp.PlanError, match="cannot ask scontrol for the nodes' addresses"):
        lp.node_addresses(["n1"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(hosts=["a", "b"], sglang_nodes=2), "leaves no node for the trainer"),
    (dict(hosts=["a", "b"], sglang_nodes=-1), "must be >= 0"),
    (dict(hosts=["a", "b"], sglang_nodes=1, server_tp=16), "more than the 8 GPUs"),
    (dict(hosts=["a", "b"], sglang_nodes=1, server_tp=4, servers_per_node=3), "do not fit a node of 8"),
    (dict(hosts=["a"], sglang_nodes=1, server_tp=8), "leave none of the 8 GPUs"),
    (dict(hosts=["a", "a"], sglang_nodes=1), "repeats a host"),
    (dict(hosts=[], sglang_nodes=0), "no nodes"),
])
def test_layouts_that_do_not_fit_are_named(kwargs, match):
    hosts = kwargs.pop("hosts")
    with pytest.raises(lp.PlanError, match=match):
        lp.make_plan(hosts, gpus_per_node=8, tasks_per_node=8, job_id=1, **kwargs)


def test_ports_stay_in_range_and_consecutive_jobs_do_not_share_server_ports():
    for spn in (1, 2, 8, 3):
        seen = set()
        for job in range(100000, 100000 + 10000 // spn):
            base = lp.server_base_port(job, spn)
            block = set(range(base, base + spn))
            assert 10000 <= base and base + spn <= 20000
            assert not (block & seen), f"job {job} reuses a port with {spn} servers per node"
            seen |= block
    assert {lp.master_port(j) for j in range(10**6, 10**6 + 10000)} == set(range(20000, 30000))


@pytest.mark.parametrize("text,count", [("8", 8), ("gpu:8", 8), ("h100:4", 4), ("", 0), (None, 0), ("0", 0)])
def test_parse_gpu_count(text, count):
    assert lp.parse_gpu_count(text) == count


def test_parse_gpu_count_rejects_garbage():
    with pytest.raises(lp.PlanError, match="GPU count"):
        lp.parse_gpu_count("gpu:a100:eight")


@pytest.mark.parametrize("text,count", [("8", 8), ("8(x16)", 8), ("2(x2),1", 2), ("", 1)])
def test_parse_tasks_per_node(text, count):
    assert lp.parse_tasks_per_node(text) == count


@pytest.mark.parametrize("text", ["eight", "8(x2", "8abc"])
def test_parse_tasks_per_node_rejects_garbage(text):
    with pytest.raises(lp.PlanError, match="cannot read a task count"):
        lp.parse_tasks_per_node(text)


def test_server_gpu_slices():
    assert lp.server_gpu_slice(1, 4, None, 8) == "4,5,6,7"
    assert lp.server_gpu_slice(0, 2, "3,5,6,7", 4) == "3,5"  # indexes into what SLURM made visible
    assert lp.server_gpu_slice(0, 1, None, 0) == ""
    with pytest.raises(lp.PlanError, match="needs devices"):
        lp.server_gpu_slice(2, 4, None, 8)


def test_api_key_file_is_private_and_fresh(tmp_path):
    path = tmp_path / "key"
    lp.write_api_key(str(path))
    first = lp.read_api_key(str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(first) == 64
    lp.write_api_key(str(path))
    assert lp.read_api_key(str(path)) != first
    assert [p.name for p in tmp_path.iterdir()] == ["key"]


def _serve(tmp_path, *serve_flags, **env_vars) -> dict:
    """Run ``launch_plan.py serve`` with a probe as the server command; what the 'server' saw."""
    key_file = tmp_path / "key"
    lp.write_api_key(str(key_file))
    probe = ("import json, os, sys; print(json.dumps({'argv': sys.argv[1:], "
             "'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'), 'gloo': os.environ.get('GLOO_SOCKET_IFNAME'), "
             "'cumem': os.environ.get('NCCL_CUMEM_ENABLE')}))")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_CUMEM_ENABLE")}
    env.update(SLURM_LOCALID="1", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7", **env_vars)
    out = subprocess.run(
        [sys.executable, str(LAUNCH_PLAN), "serve",
         "--server-cmd", f"{shlex.quote(sys.executable)} -c {shlex.quote(probe)}",
         "--model-path", "/models/q", "--api-key-file", str(key_file), "--base-port", "15000", "--tp", "4",
         "--gpus-per-node", "8", *serve_flags, "--extra-args", "--mem-fraction-static 0.8"],
        capture_output=True, text=True, env=env, timeout=60, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_serve_execs_the_server_with_this_tasks_port_gpus_and_key(tmp_path):
    seen = _serve(tmp_path)
    key_file = tmp_path / "key"
    argv = seen["argv"]
    assert argv[argv.index("--port") + 1] == "15001"
    assert argv[argv.index("--tp") + 1] == "4"
    assert f"--api-key={key_file.read_text().strip()}" in argv  # one word: a key is never read as an option
    assert argv[argv.index("--model-path") + 1] == "/models/q"
    assert argv[-2:] == ["--mem-fraction-static", "0.8"]
    assert seen["cuda"] == "4,5,6,7"
    assert seen["gloo"] is None  # no MASTER_ADDR: nothing to reach
    assert "--dtype" not in argv and seen["cumem"] is None  # neither asked for


def test_serve_passes_the_served_dtype_and_turns_nccl_cumem_off_for_nccl_weight_sync(tmp_path):
    seen = _serve(tmp_path, "--dtype", "bfloat16", "--nccl-weight-sync")
    argv = seen["argv"]
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert seen["cumem"] == "0"
    assert server_argv_dtype(["--dtype=float16"]) == ["--dtype=float16"]  # the user's --dtype wins


def server_argv_dtype(extra: list[str]) -> list[str]:
    argv = lp.server_argv("python -m sglang.launch_server", model_path="m", host="h", port=1, api_key="k", tp=1,
                          dtype="bfloat16", extra_args=" ".join(extra))
    return [a for a in argv if a.startswith("--dtype") or a in ("bfloat16", "float16")]


def test_serve_pins_gloo_to_the_interface_that_reaches_the_trainer(tmp_path):
    """The distributed weight transport's gloo group is hosted by the trainer at MASTER_ADDR."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed: no independent list of this machine's addresses")
    local = [(name, address) for _, name in socket.if_nameindex()
             if (address := _ipv4_of(name)) and not address.startswith("127.")]
    if not local:
        pytest.skip("this machine has no non-loopback IPv4 address")
    name, address = local[0]
    assert _serve(tmp_path, MASTER_ADDR=address)["gloo"] == name
    assert _serve(tmp_path, MASTER_ADDR="127.0.0.1")["gloo"] is None  # a one-host job keeps gloo's default
    assert _serve(tmp_path, MASTER_ADDR=address, GLOO_SOCKET_IFNAME="ib7")["gloo"] == "ib7"  # the user's choice


def _ipv4_of(interface: str) -> str | None:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", interface], capture_output=True, text=True)
    words = out.stdout.split()
    return words[words.index("inet") + 1].split("/")[0] if "inet" in words else None


class _Health(http.server.BaseHTTPRequestHandler):
    ready = False

    def do_GET(self):  # noqa: N802 (http.server naming)
        self.send_response(200 if self.path == "/health" and type(self).ready else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    handler = type("Handler", (_Health,), {"ready": False})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_wait_healthy_returns_once_every_server_answers(health_server):
    url, handler = health_server
    threading.Timer(0.3, lambda: setattr(handler, "ready", True)).start()
    assert lp.wait_healthy([url], "k", deadline_s=10, poll_s=0.1) == []


def test_wait_healthy_gives_up_at_the_deadline(health_server):
    url, _ = health_server
    assert lp.wait_healthy([url, "http://127.0.0.1:9"], "k", deadline_s=0.3, poll_s=0.1) == [url, "http://127.0.0.1:9"]


def test_wait_healthy_stops_when_the_server_step_exits(health_server):
    url, _ = health_server
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert lp.wait_healthy([url], "k", deadline_s=60, watch_pid=proc.pid, poll_s=0.1) == [url]


def test_plan_cli_output_is_shell_assignments():
    out = subprocess.run([sys.executable, str(LAUNCH_PLAN), "plan", "--hosts", "n1,n2,n3", "--job-id", "42",
                          "--sglang-nodes", "1", "--gpus-per-node", "gpu:8", "--tasks-per-node", "8(x3)",
                          "--server-tp", "8"], capture_output=True, text=True, check=True).stdout
    values = dict(line.split("=", 1) for line in out.splitlines())
    assert values["TRAINER_NTASKS"] == "16" and values["SERVER_NTASKS"] == "1" and values["MASTER_ADDR"] == "n2"


def test_plan_cli_reports_a_bad_layout():
    out = subprocess.run([sys.executable, str(LAUNCH_PLAN), "plan", "--hosts", "n1", "--job-id", "42",
                          "--sglang-nodes", "2"], capture_output=True, text=True)
    assert out.returncode == 2 and "leaves no node for the trainer" in out.stderr


def test_server_settings_come_from_the_trainer_config(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: {source: hf, hf_path: /models/a, precision: bf16}\ndata: {source: synthetic}\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def run(*extra):
        out = subprocess.run([sys.executable, str(LAUNCH_PLAN), "server-settings", *extra[:2], str(config),
                              *extra[2:]], capture_output=True, text=True, env=env)
        settings = dict(line.split("=", 1) for line in out.stdout.split()) if out.returncode == 0 else None
        return out, settings

    _, settings = run("--gpus-per-node", "gpu:8")
    assert settings == {"MODEL_PATH": "/models/a", "SERVER_DTYPE": "bfloat16", "SERVER_NCCL_WEIGHT_SYNC": "0"}
    _, settings = run("--gpus-per-node", "gpu:8", "model.hf_path=/models/b", "model.precision=fp32",
                      "rollout.sglang.transport=distributed", "--resume")
    assert settings == {"MODEL_PATH": "/models/b", "SERVER_DTYPE": "float32", "SERVER_NCCL_WEIGHT_SYNC": "1"}
    _, settings = run("--gpus-per-node", "", "rollout.sglang.transport=distributed")  # CPU nodes: gloo
    assert settings["SERVER_NCCL_WEIGHT_SYNC"] == "0"
    bad, _ = run("--gpus-per-node", "", "trainer.no_such_key=1")
    assert bad.returncode == 2 and "trainer.no_such_key" in bad.stderr
    tiny, _ = run("--gpus-per-node", "", "model.source=tiny")
    assert tiny.returncode == 2 and "model.hf_path" in tiny.stderr
