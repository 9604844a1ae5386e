"""The backend: every choice that depends on the platform the policy runs on, made once per process — the one home
of device decisions, at the bottom of the import graph: nothing here imports the layers that use it
(tests/unit/test_import_layers.py checks it).

:func:`dapo_megatron.backend_registry.select_backend` picks one of three from the platform and ``model.kernels``;
the policy, the actor, the weight handoff and the rollout side ask it instead of looking at the platform themselves:

=================================== ============ ============================ ========== ===================== =========
backend                             when         layer spec                   rows       TP gather (handoff)   redirect
=================================== ============ ============================ ========== ===================== =========
:class:`TransformerEngineBackend`   CUDA + TE    Transformer Engine (fused    THD        process group (NCCL)  none
                                                 attention, BF16/FP8)
:class:`CudaLocalBackend`           CUDA, no TE  megatron's local spec with   THD        process group (NCCL)  none
                                                 torch SDPA per packed sample
:class:`~dapo_megatron.cpu.backend  no CUDA      :mod:`dapo_megatron.cpu`     segments   shared memory on one  megatron
.CpuBackend`                                     layers                                  host, else gloo       on CPU
=================================== ============ ============================ ========== ===================== =========

``model.kernels``: ``auto`` takes Transformer Engine on CUDA when it imports, else the local spec with SDPA, and says
so in the log (a GPU without TE must never run the CPU path by accident); ``transformer_engine`` refuses to start
without it, naming the package; ``local`` asks for the local spec on purpose. Without CUDA the CPU backend runs
whatever ``kernels`` says, except ``transformer_engine``.

The backend supplies:

* ``prepare_process()`` — anything the process needs before megatron runs (the CPU backend installs
  :mod:`dapo_megatron.overrides.megatron_core.cpu_compat`);
* ``layer_spec(spec, num_layers)`` and ``rope_in_attention`` — what :func:`dapo_megatron.policy.model.build_model`
  builds;
* ``packer`` — how the actor lays samples out in rows (:class:`dapo_megatron.backend.interfaces.RowPacker`);
* ``tp_gather`` — how the weight handoff gathers TP shards (:mod:`dapo_megatron.handoff.tp_gather`);
* ``host_compute()`` — a context for host-side tensor work that never names CUDA (packing, the embedded engine's
  generation): the CPU backend runs it without megatron's device redirect, which only slows it down there;
* ``recompute(requested)`` — the activation recomputation a run uses (none on CPU, where memory is not the limit);
* ``sglang_server_environment(env)`` — the environment an SGLang server needs on this platform.

The modules: :mod:`~dapo_megatron.backend.base` (the :class:`Backend` interface) and
:mod:`~dapo_megatron.backend.interfaces` (the packer and TP-gather interfaces it hands out), the bottom;
:mod:`~dapo_megatron.platform`, which applies the choice to the process (device, process group, seeds);
and :func:`dapo_megatron.overrides.megatron_core.process.apply_megatron_core_overrides`, what every backend fixes in
megatron-core (``prepare_process``). The implementations live above what they use: :mod:`dapo_megatron.cuda.backend`
(the CUDA backends), :mod:`dapo_megatron.cpu.backend`, and :mod:`dapo_megatron.backend_registry` (``select_backend``),
the one module that knows them all.
"""
