"""What one streamed ``/generate`` reply costs trainer rank 0's process, with ``rollout.sglang.reply_processes: 0``
(it parses the JSON in a thread, holding the GIL) next to ``N > 0`` (a worker parses it; rank 0 unpickles the arrays
and makes the ``Sample`` lists).

    python bench/bench_reply_parsing.py [--samples 16] [--tokens 20000] [--repeats 3]

The reply is SGLang 0.5.23's shape (per token an id, a log-prob and a version span), built here; no server runs.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time

from dapo_megatron.rollout.engine import GenerationRequest, SamplingParams
from dapo_megatron.rollout.sglang.reply_workers import _compact, _sample
from dapo_megatron.rollout.sglang.requests import streamed_samples


def reply(samples: int, tokens: int) -> bytes:
    outputs = [{"output_ids": list(range(tokens)), "meta_info": {
        "output_token_logprobs": [[-0.123456789 * (k % 7), k, None] for k in range(tokens)],
        "finish_reason": {"type": "length"}, "weight_version": "3",
        "weight_versions": [{"version": "3", "start": 0, "end": tokens}]}} for _ in range(samples)]
    return json.dumps(outputs).encode()


def best_of(repeats: int, call) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    raw = reply(args.samples, args.tokens)
    request = GenerationRequest("r", (1, 2), SamplingParams(n=args.samples, max_new_tokens=args.tokens))
    samples = streamed_samples(json.loads(raw), request, "bench")
    blob = pickle.dumps([_compact(sample) for sample in samples])
    assert [_sample(fields) for fields in pickle.loads(blob)] == samples
    in_thread = best_of(args.repeats, lambda: streamed_samples(json.loads(raw), request, "bench"))
    from_worker = best_of(args.repeats, lambda: [_sample(fields) for fields in pickle.loads(blob)])
    print(f"reply: {args.samples} x {args.tokens} tokens, {len(raw) / 1e6:.1f} MB of JSON, "
          f"{len(blob) / 1e6:.1f} MB of pickled arrays")
    print(f"rank 0's process per reply: reply_processes=0 {in_thread * 1e3:.0f} ms | "
          f"reply_processes>0 {from_worker * 1e3:.0f} ms | ratio {in_thread / from_worker:.1f}x")


if __name__ == "__main__":
    main()
