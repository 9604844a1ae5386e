"""What a run reports: one step's scalars and console line (:mod:`.step`), where they go (:mod:`.writer`:
``metrics.jsonl``; :mod:`.loggers`: TensorBoard, W&B, MLflow, validation generations), the reflection-phrase counts
(:mod:`.reflection`) and ``dapo-megatron plot`` (:mod:`.plot`).
"""
