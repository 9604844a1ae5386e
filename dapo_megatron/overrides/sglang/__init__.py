"""Workarounds of SGLang 0.5.23 behaviour on the trainer's side (the table: ``dapo_megatron/overrides/README.md``).

* :mod:`.ipc_handles` — CUDA IPC handles naming their GPU by UUID for the weight-update payloads only, on torch's own
  reducers even where SGLang's process-wide patch of them is active.
"""
