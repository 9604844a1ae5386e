"""The CUDA backends (:mod:`.backend`): Transformer Engine's layers, or megatron's local layers with torch's SDPA
attention; the counterpart of :mod:`dapo_megatron.cpu`. :mod:`dapo_megatron.backend_registry` picks one."""
