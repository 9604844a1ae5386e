"""What every row of the GPU check (:mod:`gpu_check`, :mod:`gpu_check_colocated`) is made of: the shapes it runs
at (:data:`FULL` on a lent GPU, :data:`TINY` on CPU), a table row, random DAPO samples, the default objective, and
a device sync for timing."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CheckShapes:
    parity_model: dict  # published_hf_config arguments of the parity / handoff model
    mfu_models: tuple  # (label, published_hf_config arguments)
    samples: int  # parity / DAPO samples
    prompt_tokens: tuple[int, int]
    response_tokens: tuple[int, int]
    token_budget: int  # packed micro-batch tokens for the MFU rows
    rows_per_update: int
    timed_updates: int
    matmul_size: int
    copy_bytes: int
    repeats: int = 3


FULL = CheckShapes(
    parity_model=dict(name="Qwen2.5-0.5B", num_hidden_layers=4),
    mfu_models=(("0.5B-shaped", dict(name="Qwen2.5-0.5B")), ("1.5B-shaped", dict(name="Qwen2.5-1.5B"))),
    samples=16, prompt_tokens=(64, 256), response_tokens=(128, 768),
    token_budget=8192, rows_per_update=4, timed_updates=3, matmul_size=8192, copy_bytes=1 << 30,
)
_TINY_SHAPE = dict(num_hidden_layers=2, num_key_value_heads=2, vocab_size=384, max_position_embeddings=512,
                   bos_token_id=0, eos_token_id=0)
TINY = CheckShapes(
    parity_model=dict(_TINY_SHAPE, name="Qwen2.5-0.5B", hidden_size=64, intermediate_size=128, num_attention_heads=4),
    mfu_models=(("0.5B-shaped (tiny)", dict(_TINY_SHAPE, name="Qwen2.5-0.5B", hidden_size=64, intermediate_size=128,
                                            num_attention_heads=4)),
                ("1.5B-shaped (tiny)", dict(_TINY_SHAPE, name="Qwen2.5-1.5B", hidden_size=96, intermediate_size=192,
                                            num_attention_heads=6))),
    samples=6, prompt_tokens=(4, 12), response_tokens=(6, 24),
    token_budget=128, rows_per_update=2, timed_updates=1, matmul_size=256, copy_bytes=1 << 22, repeats=2,
)


@dataclass
class Row:
    check: str
    value: str
    detail: str
    numbers: dict = field(default_factory=dict)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_samples(count: int, vocab: int, prompt: tuple[int, int], response: tuple[int, int], seed: int):
    from dapo_megatron.policy.packing import PolicySample

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        p = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=generator))
        r = int(torch.randint(response[0], response[1] + 1, (1,), generator=generator))
        samples.append(PolicySample(torch.randint(0, vocab, (p,), generator=generator),
                                    torch.randint(0, vocab, (r,), generator=generator),
                                    advantage=1.0 if i % 2 == 0 else -1.0))
    return samples


def dapo_loss():
    """The schema's default objective, as a run builds it."""
    from dapo_megatron.algorithm import build_policy_loss
    from dapo_megatron.config import AlgorithmConfig

    return build_policy_loss(AlgorithmConfig())
