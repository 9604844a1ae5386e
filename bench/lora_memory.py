"""What training keeps besides activations, full fine-tuning vs LoRA, measured on megatron's own objects, next to what
``dapo-megatron plan`` predicts for the same model and layout (dapo_megatron/policy/memory/: gpu.py, lora.py).

    nice -n 10 python bench/lora_memory.py [--hidden 512] [--layers 8] [--rank 16]

One CPU process builds the policy (bf16 parameters, megatron's distributed optimizer at DP 1, the CPU layers) from a
random Qwen2-shaped HF folder twice — every parameter trained, then the base frozen with rank-``r`` adapters on every
linear — takes one DAPO update on random samples (Adam creates its moments at the first step) and reads the bytes of
the weights, DDP's gradient buffers, the optimizer's fp32 main copies and Adam's moments
(:func:`dapo_megatron.policy.optimizer.training_state_bytes`). Prints one table: each component measured and planned,
full and LoRA, and LoRA's share.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def write_model(directory: Path, *, hidden: int, layers: int) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(directory, safe_serialization=True)
    return directory


def measure(hf_dir: Path, rank: int | None) -> dict[str, int]:
    from actor_harness import actor_settings, build_test_actor, loss_of, random_samples

    from dapo_megatron.config import LoRAConfig, ModelConfig, ParallelConfig
    from dapo_megatron.policy.optimizer import training_state_bytes

    lora = LoRAConfig(enabled=rank is not None, rank=rank or 16)
    settings = actor_settings(model=ModelConfig(precision="bf16", lora=lora),
                              parallel=ParallelConfig(use_distributed_optimizer=True))
    actor, _ = build_test_actor(hf_dir, 1, 1, settings)
    actor.train_minibatch(random_samples(4, seed=0, vocab_size=8192), loss_of())
    return training_state_bytes(actor.model, actor.optimizer)


def planned(hf_dir: Path, rank: int | None) -> dict[str, int]:
    from dapo_megatron.config import LoRAConfig
    from dapo_megatron.policy.hf_loader import load_model_spec
    from dapo_megatron.policy.memory.lora import with_lora
    from dapo_megatron.policy.memory.gpu import estimate_memory

    spec = load_model_spec(hf_dir)
    layout = dict(tensor_parallel=1, data_parallel=1, precision="bf16", micro_batch_tokens=4096, recompute="selective")
    stages = estimate_memory(spec, pipeline_parallel=1, distributed_optimizer=True, **layout)
    if rank is not None:
        stages = with_lora(stages, spec, LoRAConfig(enabled=True, rank=rank), expert_parallel=1,
                           distributed_optimizer=True, transformer_engine=False, sequence_parallel=False, **layout)
    (stage,) = stages
    moments = (stage.parameters - stage.frozen_parameters) * 8
    return {"weights": stage.params_bytes, "grad_buffers": stage.grads_bytes,
            "main_params": stage.optimizer_bytes - moments, "moments": moments}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args(argv)
    from dapo_megatron.platform import destroy_distributed

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = write_model(Path(tmp) / "hf", hidden=args.hidden, layers=args.layers)
        rows = {}
        for name, rank in (("full", None), ("lora", args.rank)):
            rows[name] = (measure(hf_dir, rank), planned(hf_dir, rank))
            destroy_distributed()
    print(f"Qwen2-shaped, hidden {args.hidden}, {args.layers} layers; bf16, distributed optimizer, DP 1; LoRA rank "
          f"{args.rank} on every linear. MB = 10^6 bytes; measured: training_state_bytes, planned: plan's model.")
    print(f"| {'':<13} | full measured | full planned | LoRA measured | LoRA planned | LoRA / full |")
    print("|---|---|---|---|---|---|")
    for key in ("weights", "grad_buffers", "main_params", "moments"):
        full, lora = rows["full"], rows["lora"]
        share = lora[0][key] / full[0][key] if full[0][key] else float("nan")
        print(f"| {key:<13} | {full[0][key] / 1e6:13.2f} | {full[1][key] / 1e6:12.2f} | {lora[0][key] / 1e6:13.2f} | "
              f"{lora[1][key] / 1e6:12.2f} | {share:11.4f} |")
    training = [sum(rows[name][0][key] for key in ("grad_buffers", "main_params", "moments")) for name in rows]
    print(f"gradients + main copies + moments: full {training[0] / 1e6:.2f} MB, LoRA {training[1] / 1e6:.2f} MB "
          f"({training[1] / training[0]:.4f} of full)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
