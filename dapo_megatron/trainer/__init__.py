"""The DAPO training loop and what it needs around it, in the order one step uses them.

* ``loop.py`` — :class:`~dapo_megatron.trainer.loop.DAPOTrainer`: ``train_step`` is one DAPO step, top to bottom;
* ``rollout_collector.py`` — steps 1–4 on rank 0: prompts → G responses → rewards → dynamic-sampling filter/buffer;
* ``samples.py`` — steps 5–7's data: advantages and overlong masks, π_old's log-probs attached, mini-batches;
* ``weight_sync.py`` — step 8: the policy's weights → the rollout engine (an engine failure is raised on every rank);
* ``step_metrics.py`` — step 9: what a step reports; ``metrics.py``: where it goes (metrics.jsonl, TensorBoard);
* ``evaluate.py`` — validation (avg@k or greedy) and ``dapo-megatron eval`` of a saved checkpoint;
* ``task.py`` — the training and validation prompts from ``data.*``;
* ``model_source.py`` — the HF folder a run starts from (the tiny model is made by :mod:`dapo_megatron.tiny_model`);
* ``checkpoint.py`` — atomic, resumable checkpoints; ``plot.py`` — ``dapo-megatron plot``.
"""
