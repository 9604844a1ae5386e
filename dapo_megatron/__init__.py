"""dapo-megatron: DAPO reinforcement-learning post-training on megatron-core, with SGLang (or an embedded engine)
generating the rollouts. The step map, stage by stage with each stage's folder, is docs/architecture.md.
"""

__version__ = "0.1.0"
