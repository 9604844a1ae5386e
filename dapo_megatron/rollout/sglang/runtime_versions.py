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

import json
import subprocess
from dataclasses import dataclass

import torch

from dapo_megatron.rollout.sglang.client import SGLangServerError

PROBE_TIMEOUT_S = 120.0  # importing a CUDA torch from a cold network filesystem can take a minute

# Runs in the servers' interpreter, which need not have dapo_megatron installed: torch only, and the same
# expressions as local_versions().
_PROBE = """
import json
import torch
nccl = torch.cuda.nccl.version() if torch.distributed.is_available() and torch.distributed.is_nccl_available() else None
print(json.dumps({"torch": torch.__version__, "nccl": ".".join(map(str, nccl)) if nccl else None}))
"""


class RuntimeMismatchError(SGLangServerError):
    """The trainer and the SGLang servers' interpreter run different torch or NCCL releases."""


@dataclass(frozen=True)
class RuntimeVersions:
    torch: str
    nccl: str | None  # None: a torch built without NCCL (the CPU build)

    def describe(self) -> str:
        return f"torch {self.torch}, NCCL {self.nccl or 'none (torch built without NCCL)'}"


def local_versions() -> RuntimeVersions:
    """This process's torch and the NCCL it bundles."""
    nccl_available = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    nccl = torch.cuda.nccl.version() if nccl_available else None
    return RuntimeVersions(torch=torch.__version__, nccl=".".join(map(str, nccl)) if nccl else None)


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
        report = json.loads(result.stdout.strip().splitlines()[-1])
        return RuntimeVersions(torch=str(report["torch"]), nccl=report["nccl"])
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
