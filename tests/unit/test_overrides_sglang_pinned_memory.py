"""dapo_megatron/overrides/sglang/pinned_memory.py: SGLang 0.5.23's LoRA layers pin host memory, which torch refuses
without an accelerator (a ``--enable-lora`` CPU server died at start); the CPU server's ``sgl_kernel`` stand-in makes
pinning a no-op in every server process. Checked in fresh interpreters: the fix changes torch for the process."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STAND_IN = REPO_ROOT / "dapo_megatron" / "cpu" / "sglang"
FIX = REPO_ROOT / "dapo_megatron" / "overrides" / "sglang" / "pinned_memory.py"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT)


def test_can_allow_pin_memory_without_accelerator_go():
    """"can it go?": SGLang's LoRA layers still ask for pinned memory without asking whether it exists, and torch
    still refuses it on a machine without an accelerator. When either stops, allow_pin_memory_without_accelerator
    (and its call in the sgl_kernel stand-in) can go."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("SGLang is not installed in this interpreter")
    layers = (Path(spec.origin).parent / "srt" / "lora" / "layers.py").read_text()  # read: importing is slow
    assert re.search(r"pin_memory=True,", layers), (
        "SGLang's LoRA layers no longer pin unconditionally: allow_pin_memory_without_accelerator can go")
    refused = _python("""
        import torch
        assert not torch.cuda.is_available()
        try:
            torch.tensor([0], pin_memory=True)
        except RuntimeError as error:
            print("refused:", error)
    """)
    assert "refused:" in refused.stdout and "accelerator" in refused.stdout, (
        "torch pins (or ignores pinning) without an accelerator now: allow_pin_memory_without_accelerator can go\n"
        + refused.stdout + refused.stderr)


def test_the_cpu_servers_stand_in_applies_it():
    """Importing the stand-in (what every CPU server process does) makes pinned factories and ``pin_memory()`` give
    ordinary tensors; the control, before the import, is torch's refusal. A second application changes nothing."""
    done = _python(f"""
        import sys
        import torch
        try:
            torch.zeros(2, pin_memory=True)
            raise SystemExit("pinning worked before the fix: no defect to show")
        except RuntimeError:
            pass
        sys.path.insert(0, {str(STAND_IN)!r})
        import sgl_kernel
        offsets = torch.tensor([0, 4], dtype=torch.int32, device="cpu", pin_memory=True)
        assert offsets.tolist() == [0, 4] and not offsets.is_pinned()
        assert torch.empty(3, pin_memory=True).shape == (3,) and torch.arange(3, pin_memory=True).tolist() == [0, 1, 2]
        batch = torch.ones(2)
        assert batch.pin_memory() is batch
        wrapped = torch.zeros
        from importlib import util
        spec = util.spec_from_file_location("again", {str(FIX)!r})
        module = util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.allow_pin_memory_without_accelerator() and torch.zeros is wrapped
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
