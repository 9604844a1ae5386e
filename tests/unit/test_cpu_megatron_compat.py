"""The device-redirect mode of the CPU layer (dapo_megatron.overrides.megatron_core.cpu_compat, point 1): what it
rewrites, that ordinary calls take its fast path, and that :func:`cpu_compat.suspended` takes it off the stack and puts
it back; and that megatron's recompute checkpoint runs under it in backward (point 4).

Whether megatron-core as a whole runs under the layer is tests/integration/test_megatron_cpu.py's job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dapo_megatron.overrides.megatron_core import cpu_compat
from dapo_megatron.overrides.megatron_core.cpu_compat import CudaToCpuMode

REPO_ROOT = Path(__file__).resolve().parents[2]
CUDA_DEVICES = ["cuda", "cuda:0", 0, torch.device("cuda"), torch.device("cuda", 0)]


def without_cuda_fails(call) -> bool:
    """True when ``call`` raises because this torch has no CUDA, with the redirect off (the control)."""
    with cpu_compat.suspended():  # the layer may be installed in this process by another test
        try:
            call()
        except (AssertionError, RuntimeError) as error:  # torch: "not compiled with CUDA" / "no accelerator"
            return "CUDA" in str(error) or "accelerator" in str(error)
    return False


@pytest.mark.parametrize("device", CUDA_DEVICES, ids=str)
def test_device_keywords_naming_cuda_land_on_the_cpu(device):
    assert not torch.cuda.is_available()
    with CudaToCpuMode():
        made = [torch.zeros(2, device=device), torch.full((2,), 3.0, device=device),
                torch.ones(2).new_zeros(3, device=device), torch.zeros_like(torch.ones(2), device=device)]
    assert all(t.device.type == "cpu" for t in made)
    assert made[1].tolist() == [3.0, 3.0] and made[2].shape == (3,)
    assert without_cuda_fails(lambda: torch.zeros(2, device=device))


def test_tensor_methods_naming_cuda_stay_on_the_cpu():
    tensor = torch.arange(3, dtype=torch.float32)
    with CudaToCpuMode():
        assert tensor.cuda() is tensor
        moved = [tensor.to("cuda"), tensor.to(torch.device("cuda", 0), torch.float64), tensor.to(device="cuda:0")]
        assert tensor.type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.int64).type() == "torch.cuda.LongTensor"
        converted = tensor.type(torch.float64)  # with an argument, type() converts as usual
    assert all(t.device.type == "cpu" and t.tolist() == [0.0, 1.0, 2.0] for t in moved)
    assert moved[1].dtype == torch.float64 and converted.dtype == torch.float64
    assert tensor.type() == "torch.FloatTensor"  # outside the mode, the truth
    assert without_cuda_fails(lambda: tensor.to("cuda")) and without_cuda_fails(tensor.cuda)


def test_calls_with_nothing_to_redirect_take_the_fast_path(monkeypatch):
    looked_at = []
    real = CudaToCpuMode._redirect
    monkeypatch.setattr(CudaToCpuMode, "_redirect",
                        staticmethod(lambda func, args, kwargs: looked_at.append(func) or real(func, args, kwargs)))
    a, weight = torch.ones(4, 3), torch.ones(2, 3)
    with CudaToCpuMode():
        out = torch.nn.functional.linear(a, weight).sum(dim=0, keepdim=True) + torch.zeros(1, 2, dtype=torch.float32)
        out = out.softmax(-1).clone()
        assert looked_at == []  # none of these calls went past the fast path
        torch.zeros(1, device="cpu")  # control: a device keyword leaves the fast path (and is left alone)
        assert looked_at == [torch.zeros]
        assert torch.ones(1, device="cuda").device.type == "cpu" and looked_at[-1] is torch.ones
        assert torch.ones(1).to(torch.float64).device.type == "cpu" and looked_at[-1] is torch.Tensor.to
    assert out.tolist() == [[0.5, 0.5]]


def run_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter: installing the layer is for the life of a process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT, env=env)


def test_suspended_takes_the_mode_off_and_puts_it_back():
    result = run_python("""
        import threading
        import torch
        from torch.overrides import TorchFunctionMode, _get_current_function_mode
        from dapo_megatron.overrides.megatron_core import cpu_compat

        def redirected():
            try:
                return torch.zeros(1, device="cuda").device.type == "cpu"
            except (AssertionError, RuntimeError) as error:
                assert "CUDA" in str(error), error
                return False

        with cpu_compat.suspended():  # not installed yet: nothing to take off
            assert not redirected()
        assert cpu_compat.install()
        assert redirected()
        with cpu_compat.suspended():
            assert _get_current_function_mode() is None and not redirected()
            assert torch.cuda.current_device() == "cpu"  # the attribute patches (point 2) stay
        assert redirected()
        try:
            with cpu_compat.suspended():
                raise KeyError("inside")
        except KeyError:
            pass
        assert redirected() and _get_current_function_mode() is cpu_compat._installed_mode

        class Passthrough(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with Passthrough():  # another mode on top: suspending would reorder the stack, so it does nothing
            with cpu_compat.suspended():
                assert redirected()
        seen = []
        worker = threading.Thread(target=lambda: seen.append(redirected()))  # modes are per thread
        worker.start()
        worker.join()
        assert seen == [False]
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_recomputation_in_backward_runs_under_the_redirect():
    """Point 4: megatron's recompute checkpoint re-runs the forward inside autograd's backward, where this thread's
    mode stack is not in force; the wrapped backward puts the redirect back (control: the unwrapped one fails)."""
    result = run_python("""
        import torch
        from dapo_megatron.overrides.megatron_core import cpu_compat
        from megatron.core.tensor_parallel import random as megatron_random

        cpu_compat.install()
        function = megatron_random.CheckpointFunction

        def allocating(x):  # what megatron's recomputed attention does: allocate its causal mask on "cuda"
            return x * torch.ones(x.shape, device="cuda")

        def recompute_backward():
            x = torch.ones(3, requires_grad=True)
            megatron_random.checkpoint(allocating, False, x).sum().backward()
            return x.grad.tolist()

        assert recompute_backward() == [1.0, 1.0, 1.0]
        wrapped = function.backward
        function.backward = staticmethod(wrapped.__wrapped__)
        try:
            recompute_backward()
            print("control did not fail")
        except (AssertionError, RuntimeError) as error:
            assert "CUDA" in str(error), error
            print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (result.stdout, result.stderr[-3000:])
