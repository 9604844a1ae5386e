"""Weight-handoff throughput next to this machine's memory-copy bandwidth, every number from the same run.

    python bench/bench_weight_handoff.py [--hidden 768 --layers 6 --vocab 32000 --repeats 3]

A random Qwen2 of the given shape is built as a megatron-core policy (CPU, fp32) at TP=1 and at TP=2 (two processes,
gloo), and its weights are handed off the way the trainer does (:func:`dapo_megatron.handoff.gather_hf_buckets_to_rank0`
then ``engine.update_weights``). Rows (best of ``--repeats``; bytes = the fp32 model):

* ``memcpy``: ``dst.copy_(src)`` of the model's size, warm pages — the reference every ratio divides by;
* ``TP=1 export``: the exporter's own work — megatron names → HF names, QKV/fc1 un-interleaved, padding cut,
  bucketed; a parameter that is an HF tensor as it is (o_proj, down_proj, norms, an unpadded vocabulary) is handed
  over without a copy, the others are copied once — so this row can exceed 1× memcpy;
* ``engine update``: the embedded engine's ``update_weights`` on ready buckets (checks + one copy into its model);
* ``TP=1 export + engine update``: the trainer's handoff at TP=1;
* ``TP=2 export, gloo``: the TP gather as a gloo ``gather`` per parameter over loopback;
* ``TP=2 export, shared memory``: the same-host gather the exporter uses on CPU
  (:mod:`dapo_megatron.cpu.shm_gather`);
* ``TP=2 export + engine update`` and ``TP=2 export + disk snapshot`` (the SGLang disk transport's folder).
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


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the destination pages is not part of a copy
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def _worker(rank: int, world: int, port: int, args, out_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from transformers import Qwen2Config

    from dapo_megatron.handoff import gather_hf_buckets_to_rank0
    from dapo_megatron.handoff.tp_gather import ProcessGroupGather
    from dapo_megatron.hf_format import nbytes, write_hf_folder
    from dapo_megatron.platform import destroy_distributed, init_distributed, seed_everything
    from dapo_megatron.policy.model import build_model, transformer_config
    from dapo_megatron.policy.model_spec import model_spec_from_hf
    from dapo_megatron.rollout.embedded.engine import EmbeddedEngine

    backend = init_distributed(tensor_parallel=world, pipeline_parallel=1).backend
    seed_everything(0)
    hf_config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=args.hidden // 64, num_key_value_heads=4,
                            intermediate_size=args.hidden * 4, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    spec = model_spec_from_hf(hf_config)
    model = build_model(spec, transformer_config(spec, backend, tensor_parallel=world, pipeline_parallel=1), backend)
    engine = EmbeddedEngine(hf_config) if rank == 0 else None
    bucket_bytes = args.bucket_mb * 2**20
    version = [0]

    def timed(consume, tp_gather=backend.tp_gather) -> tuple[float, int]:
        """Best time of ``consume(buckets)`` on rank 0 (the others drain) and the bytes it saw."""
        best, moved = float("inf"), 0
        for _ in range(args.repeats):
            torch.distributed.barrier()
            start = time.perf_counter()
            buckets = gather_hf_buckets_to_rank0(model, spec, bucket_bytes=bucket_bytes, tp_gather=tp_gather)
            moved = consume(buckets) if rank == 0 else sum(1 for _ in buckets)
            torch.distributed.barrier()
            best = min(best, time.perf_counter() - start)
        return best, moved

    def count(buckets) -> int:
        return sum(nbytes(t) for bucket in buckets for _, t in bucket)

    def counted(buckets, total: list[int]):
        for bucket in buckets:
            total[0] += sum(nbytes(t) for _, t in bucket)
            yield bucket

    def to_engine(buckets) -> int:
        total = [0]
        version[0] += 1
        engine.update_weights(counted(buckets, total), version=version[0])
        return total[0]

    def to_disk(buckets) -> int:
        total = [0]
        with tempfile.TemporaryDirectory() as tmp:
            write_hf_folder(Path(tmp) / "snapshot", counted(buckets, total))
            os.sync()
        return total[0]

    results = {}
    if world == 1:
        results["TP=1 export"] = timed(count)
        ready = [[(name, tensor.clone()) for name, tensor in bucket]
                 for bucket in gather_hf_buckets_to_rank0(model, spec, bucket_bytes=bucket_bytes,
                                                          tp_gather=backend.tp_gather)]
        best = float("inf")
        for _ in range(args.repeats):
            version[0] += 1
            start = time.perf_counter()
            engine.update_weights(iter(ready), version=version[0])
            best = min(best, time.perf_counter() - start)
        results["engine update"] = (best, count(ready))
        results["TP=1 export + engine update"] = timed(to_engine)
        results["memcpy"] = (memcpy_seconds(count(ready), args.repeats), count(ready))
    else:
        results["TP=2 export, gloo"] = timed(count, ProcessGroupGather())
        results["TP=2 export, shared memory"] = timed(count)  # the CPU backend's gather
        results["TP=2 export + engine update"] = timed(to_engine)
        results["TP=2 export + disk snapshot"] = timed(to_disk)
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
    from dapo_megatron.launch_env import free_port

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2):
            out_file = f"{tmp}/results_{world}.pt"
            mp.spawn(_worker, args=(world, free_port(), args, out_file), nprocs=world, join=True)
            results.update(torch.load(out_file))
    memcpy_s, model_bytes = results.pop("memcpy")
    bandwidth = model_bytes / memcpy_s
    print(f"model: {model_bytes / 4e6:.1f}M parameters, {model_bytes / 2**20:.0f} MiB fp32, buckets of "
          f"{args.bucket_mb} MiB, one thread per rank")
    print(f"{'memcpy (tensor.copy_, same run)':<36}{memcpy_s:7.3f} s {bandwidth / 2**30:7.2f} GiB/s   1.000 x memcpy")
    for label, (seconds, moved) in results.items():
        rate = moved / seconds
        print(f"{label:<36}{seconds:7.3f} s {rate / 2**30:7.2f} GiB/s {rate / bandwidth:7.3f} x memcpy")


if __name__ == "__main__":
    main()
