"""What a run reports: one step's scalars and console line (:mod:`.step`), where they go (:mod:`.writer`:
``metrics.jsonl``; :mod:`.loggers`: TensorBoard, W&B, MLflow, validation generations) and ``dapo-megatron plot``
(:mod:`.plot`). The rollouts' own scalars are the collectors' (:mod:`dapo_megatron.collectors.rollout_metrics`).
"""
