"""Data pipeline: DAPO-Math-17K / AIME loading and validation (``dapo_math``, ``schema``), chat-template prompts
(``prompts``), a resumable sampler (``sampler``), avg@k evaluation (``evaluation``), the synthetic arithmetic task
(``synthetic``) and the tiny tokenizer for CPU runs (``tokenizer``). Import from the submodules; this package module
imports nothing so that light users (the sampler, the synthetic task) do not pay for ``transformers``/``datasets``."""
