"""Time and peak memory per process of the checkpoint tools, relative to the size of the model.

A random Qwen2-shaped model (default ~100M parameters: vocab 32000, hidden 768, 8 layers, 12 heads / 4 KV heads,
ffn 2048, untied, fp32 ≈ 400 MB) is written as an HF folder (sharded safetensors + index). Then, for each layout,
``python -m checkpoint_tools.hf_to_megatron`` and ``python -m checkpoint_tools.megatron_to_hf`` run exactly as a user
runs them, while this script samples the resident memory (RSS) of the CLI process and of each rank it spawns every
``--sample-ms``. The same is done for a tiny model (~0.1M parameters): its peak is the fixed cost of a process that
has imported torch, megatron-core and transformers, so ``(peak − tiny peak) / model bytes`` is what the conversion
itself costs in memory. Children of the ranks (dist_checkpointing's writer and Manager processes) are not counted:
forked writers share the rank's pages and would be counted twice.

    python bench/bench_checkpoint_conversion.py --layouts 1x1,2x2 [--json out.json]

Per-process expectation: a rank holds its 1/(TP·PP) of the model; megatron_to_hf's rank 0 also one output shard
(``--max-shard-size``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # checkpoint_tools from this checkout, also when the package is not installed


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int = 32000
    hidden_size: int = 768
    num_layers: int = 8
    num_heads: int = 12
    num_kv_heads: int = 4
    intermediate_size: int = 2048


@dataclass
class RunMeasurement:
    tool: str
    layout: str
    wall_s: float
    peak_rss_mb: dict[str, float] = field(default_factory=dict)  # "cli" and "rank N" → MiB
    peak_anon_mb: dict[str, float] = field(default_factory=dict)  # RSS minus file-backed pages (mmap'd inputs)


def write_random_hf_model(directory: Path, shape: ModelShape, *, max_file_bytes: int = 100 * 2**20) -> int:
    """A random fp32 Qwen2 HF folder, tensor by tensor, in files of ≤ ``max_file_bytes``; returns the weight bytes."""
    from transformers import Qwen2Config

    from checkpoint_tools.hf_to_megatron import expected_hf_tensors
    from dapo_megatron.hf_format import bucketed, write_hf_folder
    from dapo_megatron.policy.model_spec import model_spec_from_hf

    config = Qwen2Config(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                         num_key_value_heads=shape.num_kv_heads, intermediate_size=shape.intermediate_size,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    config.architectures = ["Qwen2ForCausalLM"]
    generator = torch.Generator().manual_seed(0)
    shapes = expected_hf_tensors(model_spec_from_hf(config))
    tensors = ((name, torch.randn(tensor_shape, generator=generator) * 0.02) for name, tensor_shape in shapes.items())
    write_hf_folder(directory, bucketed(tensors, max_file_bytes))
    config.save_pretrained(directory)
    return sum(torch.Size(tensor_shape).numel() * 4 for tensor_shape in shapes.values())


def _is_rank(process: psutil.Process) -> bool:
    try:
        return "multiprocessing.spawn" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def run_measured(tool: str, args: list[str], layout: str, world_size: int, sample_s: float) -> RunMeasurement:
    """Run ``python -m checkpoint_tools.<tool> args``; sample the RSS of the CLI process and of its spawned ranks.

    With a world of one the CLI process is the rank (its spawned child is dist_checkpointing's Manager, not a rank).
    """
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", f"checkpoint_tools.{tool}", *args], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cli = psutil.Process(proc.pid)
    peaks: dict[str, float] = {}
    anon_peaks: dict[str, float] = {}
    ranks: dict[int, str] = {}
    while proc.poll() is None:
        try:
            samples = [("cli", cli)]
            for child in cli.children(recursive=False):
                if child.pid not in ranks and len(ranks) < world_size > 1 and _is_rank(child):
                    ranks[child.pid] = f"rank {len(ranks)}"
                if child.pid in ranks:
                    samples.append((ranks[child.pid], child))
            for role, process in samples:
                try:
                    memory = process.memory_info()
                except psutil.Error:
                    continue
                peaks[role] = max(peaks.get(role, 0.0), memory.rss / 2**20)
                anon_peaks[role] = max(anon_peaks.get(role, 0.0), (memory.rss - memory.shared) / 2**20)
        except psutil.Error:
            pass
        time.sleep(sample_s)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)} failed with status {proc.returncode}:\n{output}")
    return RunMeasurement(tool, layout, time.perf_counter() - started, peaks, anon_peaks)


def convert_both_ways(hf_dir: Path, work: Path, tp: int, pp: int, max_shard_size: str,
                      sample_s: float) -> list[RunMeasurement]:
    layout = f"{tp}x{pp}"
    ckpt, back = work / f"{hf_dir.name}_megatron_{layout}", work / f"{hf_dir.name}_back_{layout}"
    parallel = ["--tp", str(tp), "--pp", str(pp)]
    return [
        run_measured("hf_to_megatron", ["--hf-dir", str(hf_dir), "--out", str(ckpt), *parallel], layout, tp * pp,
                     sample_s),
        run_measured("megatron_to_hf", ["--ckpt", str(ckpt), "--out", str(back), *parallel,
                                        "--max-shard-size", max_shard_size], layout, tp * pp, sample_s),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="1x1,2x2", help="comma-separated TPxPP layouts")
    parser.add_argument("--layers", type=int, default=ModelShape.num_layers)
    parser.add_argument("--max-shard-size", default="100MB", help="megatron_to_hf output shard size")
    parser.add_argument("--sample-ms", type=float, default=20.0)
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    layouts = [tuple(int(x) for x in layout.split("x")) for layout in args.layouts.split(",")]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        shape = ModelShape(num_layers=args.layers)
        model_bytes = write_random_hf_model(work / "model", shape)
        tiny_shape = ModelShape(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                                intermediate_size=128)
        write_random_hf_model(work / "tiny", tiny_shape)
        results = []
        for tp, pp in layouts:
            baseline = convert_both_ways(work / "tiny", work, tp, pp, args.max_shard_size, args.sample_ms / 1000)
            measured = convert_both_ways(work / "model", work, tp, pp, args.max_shard_size, args.sample_ms / 1000)
            for base, run in zip(baseline, measured, strict=True):
                results.append((base, run))

    params = model_bytes // 4
    print(f"\nmodel: {params / 1e6:.1f}M parameters, {model_bytes / 2**20:.0f} MiB fp32 "
          f"({shape}); megatron_to_hf --max-shard-size {args.max_shard_size}")
    print("peak = peak RSS; anon = peak of RSS minus file-backed pages (excludes the page cache of mmap'd inputs); "
          "tiny = the same run on a ~0.1M-parameter model (process start-up and import overhead)")
    print(f"{'tool':<15} {'TPxPP':<6} {'wall s':>7} {'tiny s':>7} {'s/GB':>6}  {'process':<7} {'peak MiB':>9} "
          f"{'tiny MiB':>9} {'peak/model':>10} {'(peak-tiny)/model':>18} {'(anon-tiny anon)/model':>23}")
    for base, run in results:
        for role in sorted(run.peak_rss_mb):
            peak, tiny = run.peak_rss_mb[role], base.peak_rss_mb.get(role, 0.0)
            anon, tiny_anon = run.peak_anon_mb[role], base.peak_anon_mb.get(role, 0.0)
            print(f"{run.tool:<15} {run.layout:<6} {run.wall_s:7.1f} {base.wall_s:7.1f} "
                  f"{run.wall_s / (model_bytes / 1e9):6.1f}  "
                  f"{role:<7} {peak:9.0f} {tiny:9.0f} {peak * 2**20 / model_bytes:10.2f} "
                  f"{(peak - tiny) * 2**20 / model_bytes:18.2f} {(anon - tiny_anon) * 2**20 / model_bytes:23.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"model_bytes": model_bytes, "shape": asdict(shape),
                                         "runs": [{"tiny": asdict(b), "model": asdict(r)} for b, r in results]},
                                        indent=2))


if __name__ == "__main__":
    main()
