"""LoRA on the policy: the adapters on megatron's linears (:mod:`.adapter`), their parameters' names (:mod:`.names`,
importable without megatron), their HF (PEFT) names and tensor-parallel splits (:mod:`.mapping`) and their sizes
(:mod:`.sizes`, what a run logs and ``plan`` counts)."""
