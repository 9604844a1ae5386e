"""The policy: megatron-core GPTModel built from a Hugging Face config (``model_spec``, ``model``), its weights
(``hf_loader``, ``weight_mapping``), micro-batches (``packing``, ``batch_plan``), log-probs and training step
(``logprobs``, ``actor``, ``optimizer``), LoRA's adapters (``lora/``) and the memory plan (``memory/``)."""
