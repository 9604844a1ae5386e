"""The CPU demo's model, made before training (``dapo-megatron prepare-tiny``): a tokenizer trained locally, a small
random Qwen2-style model and, when ``warm_start.enabled``, a short supervised warm-start on the synthetic task —
written as an ordinary Hugging Face folder. Training then loads it exactly as it loads a user's model.

* :mod:`.build` — :func:`prepare_tiny_model`: tokenizer + config + random weights (+ warm-start) → HF folder;
* :mod:`.warm_start` — the supervised stage (plain PyTorch on the HF model, accuracy measured through the rollout
  engine).
"""

from dapo_megatron.tiny_model.build import prepare_tiny_model, tiny_hf_config, tiny_qwen2_config

__all__ = ["prepare_tiny_model", "tiny_hf_config", "tiny_qwen2_config"]
