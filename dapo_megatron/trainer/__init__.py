"""The DAPO training loop (``loop.py``) and what it needs around it: rollout collection with dynamic sampling,
checkpoints, metrics, validation, the supervised warm-start of the CPU demo, and plots."""
