"""The torch and NCCL versions on both ends of the distributed weight-update group, compared before it forms.

The trainer and the SGLang servers join one process group (:class:`dapo_megatron.rollout.sglang.transports.
DistributedTransport`). Every torch wheel bundles its own NCCL (torch 2.13.0: 2.29.7, torch 2.14.1: 2.30.7), and NCCL
does not form a communicator across releases: with a server environment on another torch the failure would come at
the first broadcast, as a hang until the group timeout or an opaque NCCL error. This module names both versions
before any of that, from the trainer's torch and from the interpreter that runs the servers.

Where the servers' versions come from: SGLang's ``/server_info`` reports SGLang's own version, not torch's or
NCCL's, so the servers' interpreter (``rollout.sglang.python``; default: the trainer's own) is asked with
``python -c``. For launched servers that is exactly their interpreter; attached servers (``rollout.sglang.urls``) on
other nodes are taken to run the same interpreter path on a shared filesystem, as the SLURM scripts arrange.
"""

from __future__ import annotations

import inspect
import json
import subprocess
from dataclasses import dataclass, field

from dapo_megatron.rollout.sglang.client import SGLangServerError

PROBE_TIMEOUT_S = 120.0  # importing a CUDA torch from a cold network filesystem can take a minute
NCCL_DISTRIBUTIONS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")  # the pip packages CUDA torch wheels load NCCL from


def runtime_report() -> dict:
    """This interpreter's torch and the NCCL it has LOADED, as a JSON-able dict.

    ``torch.cuda.nccl.version()`` is the NCCL torch was compiled against (a constant of the wheel); the library that
    forms communicators is the ``libnccl.so`` the process loaded, which a CUDA wheel takes from the installed
    ``nvidia-nccl-cu13`` distribution — an environment that upgraded that package alone runs another NCCL than torch
    reports. So the loaded library is asked (``ncclGetVersion``), then the installed distribution, and only then the
    compile-time number. Self-contained (stdlib + torch, imports inside): its source is what the servers' interpreter
    runs, which need not have dapo_megatron installed.
    """
    import ctypes
    import importlib.metadata
    import torch

    def loaded_library() -> str | None:
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    path = line.split()[-1] if len(line.split()) >= 6 else ""
                    if "/libnccl.so" in path:
                        return path
        except OSError:
            pass
        return None

    def decode(code: int) -> str:
        # NCCL_VERSION(X, Y, Z): X*1000 + Y*100 + Z before 2.9, X*10000 + Y*100 + Z since
        major, rest = (code // 10000, code % 10000) if code >= 20900 else (code // 1000, code % 1000)
        return f"{major}.{rest // 100}.{rest % 100}"

    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return {"torch": torch.__version__, "nccl": None, "nccl_source": None}
    library = loaded_library()
    if library is not None:
        version = ctypes.c_int()
        if ctypes.CDLL(library).ncclGetVersion(ctypes.byref(version)) == 0:
            return {"torch": torch.__version__, "nccl": decode(version.value), "nccl_source": library}
    for distribution in NCCL_DISTRIBUTIONS:
        try:
            return {"torch": torch.__version__, "nccl": importlib.metadata.version(distribution),
                    "nccl_source": f"the installed {distribution}"}
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "nccl_source": "torch's compile-time NCCL"}


_PROBE = ("import json\n" + f"NCCL_DISTRIBUTIONS = {NCCL_DISTRIBUTIONS!r}\n" + inspect.getsource(runtime_report)
          + "print(json.dumps(runtime_report()))\n")


class RuntimeMismatchError(SGLangServerError):
    """The trainer and the SGLang servers' interpreter run different torch or NCCL releases."""


@dataclass(frozen=True)
class RuntimeVersions:
    torch: str
    nccl: str | None  # None: a torch built without NCCL (the CPU build)
    nccl_source: str | None = field(default=None, compare=False)  # where the NCCL version was read

    @classmethod
    def from_report(cls, report: dict) -> "RuntimeVersions":
        return cls(torch=str(report["torch"]), nccl=report["nccl"], nccl_source=report.get("nccl_source"))

    def describe(self) -> str:
        if self.nccl is None:
            return f"torch {self.torch}, NCCL none (torch built without NCCL)"
        return f"torch {self.torch}, NCCL {self.nccl}" + (f" ({self.nccl_source})" if self.nccl_source else "")


def local_versions() -> RuntimeVersions:
    """This process's torch and the NCCL it has loaded (:func:`runtime_report`)."""
    return RuntimeVersions.from_report(runtime_report())


def python_versions(python: str) -> RuntimeVersions:
    """The torch and NCCL versions ``python`` imports, asked in a subprocess."""
    try:
        result = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except FileNotFoundError:
        raise SGLangServerError(f"SGLang server python {python!r} does not exist") from None
    except subprocess.TimeoutExpired:
        raise SGLangServerError(f"SGLang server python {python!r} did not report its torch version in "
                                f"{PROBE_TIMEOUT_S:.0f} s") from None
    if result.returncode != 0:
        raise SGLangServerError(f"SGLang server python {python!r} could not report its torch version: "
                                f"{result.stderr.strip()[-2000:]}")
    try:
        return RuntimeVersions.from_report(json.loads(result.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError, KeyError, TypeError):
        raise SGLangServerError(f"SGLang server python {python!r} printed no version report, but: "
                                f"{result.stdout.strip()[-500:]!r}") from None


def require_same_runtime(trainer: RuntimeVersions, server: RuntimeVersions, *, server_python: str,
                         backend: str) -> None:
    """Raise :class:`RuntimeMismatchError`, naming both sides' versions, unless torch and NCCL are the same."""
    if trainer == server:
        return
    raise RuntimeMismatchError(
        f"the {backend} weight-update group needs the same torch and NCCL on both ends: the trainer runs "
        f"{trainer.describe()}, the SGLang servers' python {server_python!r} runs {server.describe()}. "
        f"Install both from one constraints file (README, Installation) or use rollout.sglang.transport=disk")


def require_server_runtime_matches(server_python: str, *, backend: str) -> None:
    """Compare this process's torch/NCCL with ``server_python``'s; the distributed transport calls it before
    forming the weight-update group."""
    require_same_runtime(local_versions(), python_versions(server_python), server_python=server_python,
                         backend=backend)
