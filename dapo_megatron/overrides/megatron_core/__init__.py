"""Workarounds of megatron-core 0.16.1 (the table: ``dapo_megatron/overrides/README.md``).

* :mod:`.process` — process-wide fixes every backend applies (``Backend.prepare_process``);
* :mod:`.cpu_compat` — the compatibility layer that lets megatron-core run on CPU (the CPU backend installs it);
* :mod:`.checkpointing` — the checkpoint writer's results queue, the distributed optimizer's state layout and its
  load of torch Adam's steps (:mod:`dapo_megatron.checkpoint.save_load`);
* :mod:`.optimizer_step` — the rest of the optimizer's ``step()`` given a gradient norm (the actor's update);
* :mod:`.router_replay` — routing replay's targets without megatron's queue for a recomputation that will not come;
* :mod:`.log_levels` — what megatron-core logs that a run's log should not show (the CLI);
* :mod:`.transformer_engine_import` — a Transformer Engine that does not load, held back before megatron-core imports
  it (the CLI).

Nothing is imported here, so that :mod:`.log_levels` stays free of megatron.
"""
