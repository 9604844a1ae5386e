"""Weight-handoff throughput: Megatron shards at TP=2 → bucketed full HF tensors on rank 0 → rollout engine,
next to this machine's plain torch memory-copy bandwidth, measured in the same run.

    python bench/bench_weight_handoff.py [--hidden 768 --layers 6 --vocab 32000 --repeats 3]

Prints, for the export alone (TP all-gather + un-interleave + bucketing + gather to rank 0), for export + the
embedded engine's ``update_weights`` (the buckets handed over as they are, as the trainer does), and for export + the
snapshot the SGLang disk transport writes (one safetensors shard per bucket, index and side files:
:func:`dapo_megatron.hf_format.write_hf_folder`), the bytes/s of the fp32 model and the ratio to ``tensor.copy_``
bandwidth.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def memcpy_bandwidth(nbytes: int, repeats: int) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def _worker(rank: int, world: int, port: int, args, out_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from transformers import Qwen2Config

    from dapo_megatron.handoff import gather_hf_buckets_to_rank0
    from dapo_megatron.hf_format import nbytes, write_hf_folder
    from dapo_megatron.platform import destroy_distributed, init_distributed, seed_everything
    from dapo_megatron.policy.model import build_model, model_spec_from_hf, transformer_config
    from dapo_megatron.rollout.embedded import EmbeddedEngine

    init_distributed(tensor_parallel=world, pipeline_parallel=1)
    seed_everything(0)
    hf_config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=args.hidden // 64, num_key_value_heads=4,
                            intermediate_size=args.hidden * 4, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    spec = model_spec_from_hf(hf_config)
    model = build_model(spec, transformer_config(spec, tensor_parallel=world, pipeline_parallel=1))
    engine = EmbeddedEngine(hf_config) if rank == 0 else None
    bucket_bytes = args.bucket_mb * 2**20

    def run(consume) -> tuple[float, int]:
        torch.distributed.barrier()
        start = time.perf_counter()
        total = 0
        buckets = gather_hf_buckets_to_rank0(model, spec, bucket_bytes=bucket_bytes)
        if rank == 0:
            total = consume(buckets)
        else:
            for _ in buckets:
                pass
        torch.distributed.barrier()
        return time.perf_counter() - start, total

    def counted(buckets, total: list[int]):
        """The buckets as they are, adding up their bytes."""
        for bucket in buckets:
            total[0] += sum(nbytes(t) for _, t in bucket)
            yield bucket

    def count(buckets) -> int:
        total = [0]
        for _ in counted(buckets, total):
            pass
        return total[0]

    def to_engine(buckets) -> int:
        total = [0]
        run.version = getattr(run, "version", 0) + 1
        engine.update_weights(counted(buckets, total), version=run.version)
        return total[0]

    def to_disk(buckets) -> int:
        total = [0]
        with tempfile.TemporaryDirectory() as tmp:
            write_hf_folder(Path(tmp) / "snapshot", counted(buckets, total))
            os.sync()
        return total[0]

    results = {}
    for label, consume in (("export", count), ("export+embedded update", to_engine),
                           ("export+disk snapshot", to_disk)):
        times, moved = [], 0
        for _ in range(args.repeats):
            seconds, moved_run = run(consume)
            times.append(seconds)
            moved = moved_run or moved
        results[label] = (min(times), moved)
    if rank == 0:
        torch.save(results, out_file)
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from dapo_megatron.platform import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out_file = f"{tmp}/results.pt"
        mp.spawn(_worker, args=(2, port, args, out_file), nprocs=2, join=True)
        results = torch.load(out_file)
    model_bytes = results["export"][1]
    bandwidth = memcpy_bandwidth(model_bytes, args.repeats)
    print(f"model: {model_bytes / 4e6:.1f}M parameters, {model_bytes / 2**20:.0f} MiB fp32, TP=2, "
          f"buckets of {args.bucket_mb} MiB")
    print(f"torch memcpy bandwidth (same run): {bandwidth / 2**30:.2f} GiB/s")
    for label, (seconds, nbytes) in results.items():
        rate = nbytes / seconds
        print(f"{label:>24}: {seconds:6.2f} s  {rate / 2**30:6.3f} GiB/s  = {rate / bandwidth:.3f} x memcpy")


if __name__ == "__main__":
    main()
