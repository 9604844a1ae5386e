"""Tokens/s of the embedded engine's decode loop vs HF ``model.generate``, side by side, on the CPU-demo shape.

Both sample the same batch (``--prompts`` prompts x ``--n`` samples, left-padded, temperature 1, no truncation, stop
tokens, ``--max-new-tokens``) from the same random tiny Qwen2 model, and both produce what the trainer needs: token
ids plus the log-prob of each chosen token (``model.generate`` via ``output_logits``). The runs are interleaved
and repeated; the table shows the best and the median of each (shared machines are noisy: trust the best).

    python bench/bench_embedded_generate.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from dapo_megatron.config import EmbeddedConfig
from dapo_megatron.rollout import SamplingParams
from dapo_megatron.rollout.embedded.engine import EmbeddedEngine


def demo_sized_config(vocab_size: int, hidden_size: int, num_layers: int) -> Qwen2Config:
    """About the CPU demo's policy: 3 layers, hidden 128, 4 heads, a character vocabulary (~0.6M parameters)."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 11 // 4,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


def random_prompts(num_prompts: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(12, 18, (num_prompts,), generator=generator).tolist()
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def hf_generate_fn(
    model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams
) -> Callable[[], int]:
    """``model.generate`` on the left-padded batch, with the chosen tokens' log-probs; returns response tokens."""
    padded_length = max(len(prompt) for prompt in prompts)
    input_ids = torch.zeros(len(prompts), padded_length, dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, padded_length - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, padded_length - len(prompt) :] = 1
    stop_ids = list(params.stop_token_ids)

    def run() -> int:
        with torch.inference_mode():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=params.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=params.max_new_tokens,
                num_return_sequences=params.n,
                eos_token_id=stop_ids,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            responses = output.sequences[:, padded_length:]
            logits = torch.stack(output.logits, dim=1) / params.temperature
            torch.log_softmax(logits, dim=-1).gather(-1, responses[..., None])
            is_stop = torch.isin(responses, torch.tensor(stop_ids))
            after_stop = (is_stop.cumsum(dim=-1) - is_stop.long()) > 0  # positions past a row's stop token
            return int((~after_stop).sum())

    return run


def engine_generate_fn(engine: EmbeddedEngine, prompts: list[list[int]], params: SamplingParams) -> Callable[[], int]:
    def run() -> int:
        groups = engine.generate(prompts, params)
        return sum(len(sample.token_ids) for group in groups for sample in group)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--vocab-size", type=int, default=40)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--drop-finished-fractions", type=float, nargs="+", default=[0.25],
        help="engine variants to time (0: drop a row as soon as it finishes; >1: never drop)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = demo_sized_config(args.vocab_size, args.hidden_size, args.layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    prompts = random_prompts(args.prompts, args.vocab_size, seed=1)
    # Two stop tokens out of ~40 give responses of ~20 tokens on average, about the demo's length.
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=(1, 2),
                            seed=3)

    contenders: dict[str, Callable[[], int]] = {"hf model.generate": hf_generate_fn(model, prompts, params)}
    for fraction in args.drop_finished_fractions:
        engine = EmbeddedEngine(config, EmbeddedConfig(drop_finished_fraction=fraction))
        engine.update_weights([list(model.state_dict().items())], version=0)
        contenders[f"engine drop>={fraction:g}"] = engine_generate_fn(engine, prompts, params)

    timings: dict[str, list[float]] = {name: [] for name in contenders}
    tokens: dict[str, int] = {}
    for name, run in contenders.items():
        run()  # warm-up
    for _ in range(args.repeats):
        for name, run in contenders.items():
            start = time.perf_counter()
            tokens[name] = run()
            timings[name].append(time.perf_counter() - start)

    params_count = sum(p.numel() for p in model.parameters())
    print(
        f"model {params_count / 1e6:.2f}M params, {args.prompts} prompts x n={args.n}, "
        f"max_new_tokens={args.max_new_tokens}, threads={args.threads}, repeats={args.repeats}"
    )
    print(f"{'method':<24}{'tokens':>8}{'best s':>9}{'median s':>10}{'best tok/s':>12}{'median tok/s':>14}")
    for name, seconds in timings.items():
        best, median = min(seconds), statistics.median(seconds)
        print(
            f"{name:<24}{tokens[name]:>8}{best:>9.3f}{median:>10.3f}"
            f"{tokens[name] / best:>12.0f}{tokens[name] / median:>14.0f}"
        )


if __name__ == "__main__":
    main()
