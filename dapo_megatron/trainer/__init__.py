"""The DAPO training loop (:mod:`.loop`: ``DAPOTrainer.train_step`` is one step, top to bottom) and the stages it runs
that belong to no other folder: steps 5–7 as one stage (:mod:`.policy_update`), step 8, the weights to the engine
(:mod:`.weight_sync`), validation and ``dapo-megatron eval`` (:mod:`.evaluate`), and the trainer's turns with colocated
SGLang servers (:mod:`.colocation`). The step map is in ``docs/architecture.md``.
"""
