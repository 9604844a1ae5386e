"""The torch/NCCL check before the distributed weight-update group forms (rollout/sglang/runtime_versions.py)."""

import stat
import subprocess
import sys

import pytest
import torch

from dapo_megatron.rollout.sglang.runtime_versions import (
    RuntimeMismatchError,
    RuntimeVersions,
    local_versions,
    python_versions,
    require_same_runtime,
)
from dapo_megatron.rollout.sglang.client import SGLangServerError
from dapo_megatron.rollout.sglang.transports import DistributedTransport, ServerTarget
from dapo_megatron.user_errors import EXIT_CODES

# The pair issue 23 met: the trainer on torch 2.13.0, SGLang 0.5.23's environment on torch 2.14.1.
TRAINER = RuntimeVersions(torch="2.13.0+cu130", nccl="2.29.7")
SERVER = RuntimeVersions(torch="2.14.1+cu130", nccl="2.30.7")


def fake_python(tmp_path, stdout: str, exit_code: int = 0):
    """An 'interpreter' that ignores its arguments and prints a faked version report."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{stdout}\nEOF\nexit {exit_code}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_local_report_is_this_torch():
    versions = local_versions()
    assert versions.torch == torch.__version__
    if not torch.distributed.is_nccl_available():
        assert versions.nccl is None


FAKE_TORCH = """
__version__ = "2.14.1+cu130"
class distributed:
    is_available = staticmethod(lambda: True)
    is_nccl_available = staticmethod(lambda: True)
class cuda:
    class nccl:
        version = staticmethod(lambda: (2, 29, 7))  # what the wheel was compiled against
"""


@pytest.fixture
def nccl_torch(tmp_path, monkeypatch):
    """A server interpreter whose torch says it was compiled against NCCL 2.29.7 (a stand-in ``torch`` package on
    PYTHONPATH: the probe needs nothing of torch but these names). Returns a function that makes the process load a
    real shared library answering ``ncclGetVersion`` with ``code`` (built here with the C compiler, preloaded)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    def load_nccl(code: int):
        source = tmp_path / "nccl.c"
        source.write_text(f"int ncclGetVersion(int *version) {{ *version = {code}; return 0; }}\n")
        library = tmp_path / "libnccl.so.2"
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
        monkeypatch.setenv("LD_PRELOAD", str(library))
        return library

    def install_distribution(name: str, version: str):
        info = tmp_path / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")

    return load_nccl, install_distribution


def test_the_loaded_nccl_is_reported_not_the_one_torch_was_compiled_with(nccl_torch):
    load_nccl, install_distribution = nccl_torch
    install_distribution("nvidia-nccl-cu13", "2.28.9")  # the loaded library wins over the package metadata too
    library = load_nccl(23007)
    versions = python_versions(sys.executable)
    assert versions.nccl == "2.30.7" and versions.nccl_source == str(library)
    assert "2.30.7" in versions.describe() and str(library) in versions.describe()
    # the trainer on the compiled-in 2.29.7 is refused against it: the mismatch the compile-time number hid
    with pytest.raises(RuntimeMismatchError, match="NCCL 2.29.7.*NCCL 2.30.7"):
        require_same_runtime(RuntimeVersions("2.14.1+cu130", "2.29.7"), versions, server_python="p", backend="nccl")


def test_without_a_loaded_library_the_installed_nccl_distribution_is_reported(nccl_torch):
    _, install_distribution = nccl_torch
    install_distribution("nvidia-nccl-cu13", "2.30.7")
    versions = python_versions(sys.executable)
    assert (versions.nccl, versions.nccl_source) == ("2.30.7", "the installed nvidia-nccl-cu13")


def test_the_compiled_in_nccl_is_the_last_resort_and_says_so(nccl_torch):
    versions = python_versions(sys.executable)  # control for the two above: nothing loaded, nothing installed
    assert (versions.nccl, versions.nccl_source) == ("2.29.7", "torch's compile-time NCCL")


def test_old_nccl_version_codes_decode_too(nccl_torch):
    load_nccl, _ = nccl_torch
    load_nccl(2804)  # NCCL_VERSION(2, 8, 4) before 2.9 was X*1000 + Y*100 + Z
    assert python_versions(sys.executable).nccl == "2.8.4"


def test_subprocess_report_of_this_interpreter_equals_the_local_one():
    assert python_versions(sys.executable) == local_versions()


def test_mismatch_names_both_sides_versions():
    with pytest.raises(RuntimeMismatchError) as raised:
        require_same_runtime(TRAINER, SERVER, server_python="/envs/sglang/bin/python", backend="nccl")
    message = str(raised.value)
    for number in ("2.13.0+cu130", "2.29.7", "2.14.1+cu130", "2.30.7", "/envs/sglang/bin/python"):
        assert number in message
    assert raised.value.exit_code == EXIT_CODES["server"]


def test_same_torch_with_another_nccl_is_refused():
    other_nccl = RuntimeVersions(torch=TRAINER.torch, nccl="2.30.7")
    with pytest.raises(RuntimeMismatchError, match="NCCL 2.29.7.*NCCL 2.30.7"):
        require_same_runtime(TRAINER, other_nccl, server_python="p", backend="nccl")


def test_equal_versions_pass():
    require_same_runtime(TRAINER, RuntimeVersions(torch="2.13.0+cu130", nccl="2.29.7"), server_python="p",
                         backend="nccl")


def test_faked_server_report_is_read(tmp_path):
    python = fake_python(tmp_path, '{"torch": "2.14.1+cu130", "nccl": "2.30.7"}')
    assert python_versions(python) == SERVER


@pytest.mark.parametrize("stdout, exit_code, expected", [
    ("Traceback ...\nModuleNotFoundError: No module named 'torch'", 1, "could not report its torch version"),
    ("hello", 0, "printed no version report"),
])
def test_unusable_server_python_is_named(tmp_path, stdout, exit_code, expected):
    python = fake_python(tmp_path, stdout, exit_code)
    with pytest.raises(SGLangServerError, match=expected) as raised:
        python_versions(python)
    assert python in str(raised.value)


def test_missing_server_python_is_named(tmp_path):
    with pytest.raises(SGLangServerError, match="does not exist"):
        python_versions(str(tmp_path / "no-python"))


class GroupJoinRecorder:
    """Stands in for a server's client: records the group join and stops there (no server would answer it)."""

    base_url = "http://127.0.0.1:1"

    def __init__(self):
        self.joins = []

    def init_weights_update_group(self, **kwargs):
        self.joins.append(kwargs)
        raise ConnectionRefusedError("no server behind this client")


def test_transport_refuses_a_mismatched_server_before_the_group_forms(tmp_path):
    other_torch = "9.9.9" if torch.__version__ != "9.9.9" else "9.9.8"
    python = fake_python(tmp_path, f'{{"torch": "{other_torch}", "nccl": "2.30.7"}}')
    client = GroupJoinRecorder()
    transport = DistributedTransport(server_python=python, timeout_s=5)
    with pytest.raises(RuntimeMismatchError, match=f"torch {other_torch}, NCCL 2.30.7"):
        transport.connect([ServerTarget(client=client, tp_size=1)])
    assert client.joins == []  # nothing was asked of the server


def test_transport_with_the_same_runtime_goes_on_to_form_the_group():
    """Control: the trainer's own interpreter passes the check and the server is asked to join."""
    client = GroupJoinRecorder()
    transport = DistributedTransport(server_python=sys.executable, timeout_s=1)
    with pytest.raises(Exception):  # the stand-in refuses the join; the sender's rendezvous then times out
        transport.connect([ServerTarget(client=client, tp_size=1)])
    assert len(client.joins) == 1
