"""The memory model behind ``dapo-megatron plan`` and the input checks: one training rank's GPU memory per pipeline
stage (:mod:`.gpu`), LoRA's terms in it (:mod:`.lora`) and the host memory of a step per node (:mod:`.host`)."""
