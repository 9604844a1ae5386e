"""dapo-megatron: DAPO reinforcement-learning post-training on megatron-core, with SGLang (or an embedded engine)
generating the rollouts.

One DAPO step, and where each stage lives:

    data/ ─► rollout/ ─► reward/rule.py ─► algorithm/dynamic_sampling.py ─► algorithm/advantages.py
        ─► algorithm/loss.py (inside policy/actor.py's Megatron schedule) ─► optimizer (policy/optimizer.py)
        ─► handoff/ (Megatron shards → HF tensors → rollout engine)

The loop that strings them together is trainer/loop.py.
"""

__version__ = "0.1.0"
