"""Workarounds of SGLang 0.5.23 behaviour on the trainer's side (the table: ``dapo_megatron/overrides/README.md``).

* :mod:`.ipc_handles` — CUDA IPC handles naming their GPU by UUID for the weight-update payloads only, on torch's own
  reducers even where SGLang's process-wide patch of them is active.
* :mod:`.pinned_memory` — on the *server's* side: pinning a no-op without an accelerator, so a CPU server runs SGLang's
  LoRA layers (applied by the ``sgl_kernel`` stand-in, :mod:`dapo_megatron.cpu.sglang`).
"""
