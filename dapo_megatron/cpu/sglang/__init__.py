"""CPU compatibility pieces for an SGLang 0.5.23 *server process* (never imported by the trainer).

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports a handful of kernels from ``sgl_kernel`` at import
time. ``sgl_kernel`` (PyPI: ``sglang-kernel``) only ships CUDA builds (sm90/sm100), so on a CPU-only machine
the import fails before the server starts. This directory holds a stand-in ``sgl_kernel`` package; the SGLang
server launcher (:mod:`dapo_megatron.rollout.sglang.server`) prepends :func:`server_pythonpath` to the
server's ``PYTHONPATH`` when, and only when, the server runs with ``--device cpu``.

Nothing here changes what SGLang computes: the stand-in's functions are the CPU kernels of speculative decoding
and KV-cache copying for disaggregation/HiCache, features this project never enables; each raises if called. Its
import also applies :mod:`dapo_megatron.overrides.sglang.pinned_memory` (pinning is a no-op without an accelerator),
which SGLang's LoRA layers need on a CPU server.
"""

from __future__ import annotations

from pathlib import Path


def server_pythonpath() -> str:
    """The directory to put on a CPU SGLang server's ``PYTHONPATH`` so ``import sgl_kernel`` finds the stand-in."""
    return str(Path(__file__).resolve().parent)
