"""What scoring one step's responses costs trainer rank 0's process: rank 0's CPU seconds (``time.thread_time`` of
the calling thread, i.e. the time it holds the GIL that rank 0's kernel launches wait on) and the wall time, for

1. the decode of the responses: ``tokenizer.decode`` per response (before) next to
   :func:`~dapo_megatron.reward.response_text.response_texts` (one ``decode_batch`` call, the GIL released);
2. the built-in rule: in the trainer (``reward.builtin_in_workers: false``, the default) next to in
   ``reward.num_workers`` worker processes (``true``).

    python bench/bench_rank0_scoring.py [--responses 512] [--tokens 10000] [--workers 4] [--math-verify]

The responses are built here (the package's tiny tokenizer; random ids for the decode, long reasoning text ending in
an answer for the rule: a third exact, a third a wrong LaTeX fraction, a third with no answer line).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from dapo_megatron.config import load_config
from dapo_megatron.data.tokenizer import build_tiny_tokenizer
from dapo_megatron.reward.response_text import response_texts
from dapo_megatron.reward.scorer import RewardRequest, RewardScorer

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
ENDINGS = ("Answer: 42", "Answer: \\frac{3}{4}", "so the total is 41 or so")


def timed(call) -> tuple[float, float, object]:
    cpu, wall = time.thread_time(), time.perf_counter()
    result = call()
    return time.thread_time() - cpu, time.perf_counter() - wall, result


def report(name: str, before: tuple, after: tuple, labels: tuple[str, str]) -> None:
    assert before[2] == after[2], f"{name}: the two ways gave different results"
    for label, (cpu, wall, _) in zip(labels, (before, after)):
        print(f"  {label:32} rank 0 CPU {cpu:7.3f} s   wall {wall:7.3f} s")
    print(f"  rank 0 CPU ratio: {before[0] / max(after[0], 1e-9):.1f}x")


def bench_decode(responses: int, tokens: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = build_tiny_tokenizer(folder)
    rng = random.Random(0)
    ids = [[rng.randrange(len(tokenizer)) for _ in range(tokens)] for _ in range(responses)]
    print(f"decode: {responses} responses x {tokens} tokens")
    report("decode", timed(lambda: [tokenizer.decode(r, skip_special_tokens=True) for r in ids]),
           timed(lambda: response_texts(tokenizer, ids)), ("tokenizer.decode per response", "response_texts"))


def rule_requests(responses: int, chars: int) -> list[list[RewardRequest]]:
    rng = random.Random(0)
    words = ["let", "x", "=", "3", "then", "we", "add", "\\sqrt{2}", "so", "wait,", "check", "the", "sum"]
    groups = []
    for g in range(max(responses // 16, 1)):
        group = []
        for j in range(16):
            body = " ".join(rng.choice(words) for _ in range(chars // 4))[:chars]
            group.append(RewardRequest("math_dapo", body + "\n" + ENDINGS[(g + j) % 3], "42", {"index": g}))
        groups.append(group)
    return groups


def bench_rule(responses: int, chars: int, workers: int, math_verify: bool) -> None:
    groups = rule_requests(responses, chars)
    overrides = [f"reward.num_workers={workers}", f"algorithm.use_math_verify={math_verify}"]
    results = []
    for in_workers in (False, True):
        scorer = RewardScorer(load_config(TINY, [*overrides, f"reward.builtin_in_workers={in_workers}"]))
        try:
            scorer.score(groups[:1])  # warm: the workers' first call, math-verify's lazy imports
            results.append(timed(lambda: scorer.score(groups)))
        finally:
            scorer.close()
    print(f"rule: {sum(map(len, groups))} responses of {chars} chars, math-verify {math_verify}, {workers} workers")
    report("rule", *results, ("builtin_in_workers=false", "builtin_in_workers=true"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=10000, help="per response, for the decode")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--math-verify", action="store_true")
    args = parser.parse_args()
    bench_decode(args.responses, args.tokens)
    bench_rule(args.responses, args.tokens * 4, args.workers, args.math_verify)  # ~4 characters a token


if __name__ == "__main__":
    main()
