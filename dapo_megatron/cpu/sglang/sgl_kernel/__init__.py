"""Stand-in for ``sgl_kernel`` in a CPU SGLang 0.5.23 server process.

What it replaces: the CPU ops of the real ``sgl_kernel`` (``sglang-kernel`` on PyPI), which exists only as CUDA
builds. SGLang's CPU engine imports the names below at module import time (speculative-decoding tree
building/verification, KV-cache location assignment for speculative/disaggregated serving, all-layer KV-cache
copy). Why a stand-in is enough: with speculative decoding, disaggregation and HiCache off (this project's
server flags), none of them is called (they are used only by ``alloc_for_spec_decode``, the speculative workers
and ``copy_all_layer_kv_cache_func``); the SGLang test-suite of this project (generation, weight updates over
disk/tensor/gloo, a server restart) passes with these stand-ins, which raise ``NotImplementedError`` naming
themselves when called, so a code path that does need one fails loudly instead of computing something wrong.

The list is exactly what SGLang 0.5.23 imports for dense decoder models at TP=1; an ``ImportError`` naming
another ``sgl_kernel`` function means SGLang took a path this stand-in does not cover (a newer SGLang, an MoE or
multimodal model): add the name here only after checking that the path never calls it.
Only on the server's ``PYTHONPATH`` on CPU (see :func:`dapo_megatron.cpu.sglang.server_pythonpath`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable, NoReturn

__version__ = "0.0.0+dapo-megatron-cpu-stand-in"


def _allow_pin_memory_without_accelerator() -> None:
    """SGLang's LoRA layers pin host memory, which torch refuses without an accelerator: the override
    ``dapo_megatron/overrides/sglang/pinned_memory.py``, loaded by its path (the server's interpreter may not have
    dapo-megatron installed), applied in every CPU server process — they all import this stand-in first."""
    path = Path(__file__).resolve().parents[3] / "overrides" / "sglang" / "pinned_memory.py"
    spec = importlib.util.spec_from_file_location("dapo_megatron_sglang_pinned_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.allow_pin_memory_without_accelerator()


_allow_pin_memory_without_accelerator()


def _unavailable(name: str) -> Callable[..., NoReturn]:
    def kernel(*args, **kwargs) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is dapo-megatron's CPU stand-in for sgl_kernel, which has no "
            f"kernels: the SGLang server took a code path (speculative decoding, disaggregation, HiCache) that "
            f"needs the real CUDA sgl_kernel"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


assign_draft_cache_locs_contiguous_cpu = _unavailable("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unavailable("assign_extend_cache_locs_cpu")
assign_req_to_token_pool_cpu = _unavailable("assign_req_to_token_pool_cpu")
build_tree_kernel_efficient_cpu = _unavailable("build_tree_kernel_efficient_cpu")
copy_all_layer_kv_cache_cpu = _unavailable("copy_all_layer_kv_cache_cpu")
fill_accept_out_cache_loc_cpu = _unavailable("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unavailable("fill_bonus_tokens_cpu")
verify_tree_greedy_cpu = _unavailable("verify_tree_greedy_cpu")
