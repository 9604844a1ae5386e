"""Everything that exists only so the policy, the handoff and SGLang run (and run fast) on a machine without CUDA.

The rest of the project never imports from here: :func:`dapo_megatron.backend_registry.select_backend` picks
:class:`~dapo_megatron.cpu.backend.CpuBackend` when there is no CUDA, and the code that needs a platform choice asks
that backend.

* :mod:`dapo_megatron.overrides.megatron_core.cpu_compat` (not here: it changes megatron-core, so it sits with the
  other overrides) — the one compatibility layer that lets megatron-core run on CPU, which :mod:`.backend` installs;
* :mod:`.layers`, :mod:`.attention` — the layer spec: RMSNorm, SwiGLU and RoPE with hand-written backward passes,
  attention per packed sample;
* :mod:`.segment_packing` — the packed layout that attention reads (each prompt once per row);
* :mod:`.shm_gather` — the weight handoff's TP gather through shared memory on one host;
* :mod:`.sglang` — the ``sgl_kernel`` stand-in an SGLang server process needs on CPU;
* :mod:`.backend` — the backend that hands these out.
"""
