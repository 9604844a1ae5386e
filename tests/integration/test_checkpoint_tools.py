"""HF ↔ megatron checkpoint tools: bit-exact round trips, resharding, transformers parity, and every bad input.

Three groups, each paying for its processes once (module-scoped fixtures):

* ``cli_round_trip`` — the tools as a user runs them (``python -m ...`` subprocesses): Qwen2 (QKV bias, untied,
  vocab 101 — not a multiple of TP) → megatron at TP=1/PP=1 (fast set) and TP=2/PP=2 (4 spawned gloo ranks; slow)
  → HF in one process. Every tensor comes back bit-exact; the folder loads in ``transformers`` with identical
  logits and tokenizer. The broken-checkpoint tests start from its output.
* ``ranks`` (slow) — one set of 4 ranks (the torchrun path: RANK/WORLD_SIZE set) converts Qwen2-tied,
  Llama-untied and Llama-tied at TP=2/PP=2 and back at other layouts (1×2, 2×1 with DP=2, 2×2), and Qwen2 to a
  bf16 checkpoint and back (exactly the bf16-rounded weights); loads a TP=2/PP=1 checkpoint at TP=1/PP=2 (and 2×1)
  and compares logits with HF; feeds ``megatron_to_hf`` checkpoints that do not fit the config (missing,
  unexpected, mis-shaped tensors) and an existing output folder with and without ``force``.
* bad HF inputs and broken checkpoints — refused before any rank starts, in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spawn_ranks import run_distributed
from logit_parity import checkpoint_logits
from tiny_models import save_random_hf_model, tiny_hf_config

from checkpoint_tools import ConversionError
from checkpoint_tools.hf_to_megatron import convert_hf_to_megatron
from checkpoint_tools.megatron_to_hf import CheckpointSource, convert_megatron_to_hf, parse_size, resolve_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
SEQ_LEN = 12
MODELS = {  # name → config factory; all hidden 48, 4 layers, 6 heads / 2 KV heads, ffn 96, vocab 101
    "qwen2_untied": lambda: tiny_hf_config("qwen2", vocab_size=101),
    "qwen2_tied": lambda: tiny_hf_config("qwen2", vocab_size=101, tie_word_embeddings=True),
    "llama_untied": lambda: tiny_hf_config("llama", vocab_size=101),
    "llama_tied": lambda: tiny_hf_config("llama", vocab_size=101, tie_word_embeddings=True),
}
# megatron_to_hf layout for the round trips run inside the ranks (the CLI round trip uses the default 1×1)
BACK_LAYOUTS = {"qwen2_tied": (1, 2), "llama_untied": (2, 1), "llama_tied": (2, 2)}


def _read_folder(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _bit_differences(original: Path, converted: Path) -> list[str]:
    """Names whose set, dtype, shape or bytes differ between two HF folders (empty: bit-exact)."""
    a, b = _read_folder(original), _read_folder(converted)
    problems = [f"only in original: {sorted(set(a) - set(b))}"] if set(a) - set(b) else []
    problems += [f"only in converted: {sorted(set(b) - set(a))}"] if set(b) - set(a) else []
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            problems.append(f"{name}: {x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}")
    return problems


def _leftovers(parent: Path) -> list[str]:
    """Hidden staging folders (``.<name>.tmp-*`` / ``.<name>.old-*``) left in ``parent``."""
    return sorted(p.name for p in parent.iterdir()
                  if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The four tiny HF folders (Qwen2-untied also with a tokenizer) and HF's logits for Qwen2-untied."""
    from tiny_models import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for i, (name, make_config) in enumerate(MODELS.items()):
        dirs[name] = root / name
        model = save_random_hf_model(dirs[name], make_config(), seed=40 + i)
        if name == "qwen2_untied":
            tokens = torch.randint(0, 101, (2, SEQ_LEN), generator=torch.Generator().manual_seed(5))
            with torch.no_grad():
                reference_logits = model(tokens).logits
    build_tiny_tokenizer(0).save_pretrained(dirs["qwen2_untied"])
    return dirs, tokens, reference_logits


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


# --------------------------------------------------------------------------------------------- the CLIs, end to end
@pytest.fixture(scope="module", params=[pytest.param((1, 1), id="tp1-pp1"),
                                        pytest.param((2, 2), id="tp2-pp2", marks=pytest.mark.slow)])  # 5 processes
def cli_round_trip(request, models, tmp_path_factory):
    """Qwen2 → megatron at TP×PP (1×1: in the CLI process; 2×2: 4 spawned ranks) → HF in one process."""
    dirs, _, _ = models
    tp, pp = request.param
    root = tmp_path_factory.mktemp(f"cli_tp{tp}_pp{pp}")
    ckpt, back = root / "megatron", root / "hf_back"
    to_megatron = _cli("checkpoint_tools.hf_to_megatron", "--hf-dir", str(dirs["qwen2_untied"]), "--out", str(ckpt),
                       "--tp", str(tp), "--pp", str(pp))
    assert to_megatron.returncode == 0, to_megatron.stderr
    to_hf = _cli("checkpoint_tools.megatron_to_hf", "--ckpt", str(ckpt), "--out", str(back),
                 "--max-shard-size", "100KB")
    assert to_hf.returncode == 0, to_hf.stderr
    return ckpt, back


def test_hf_to_megatron_writes_the_trainer_layout(models, cli_round_trip):
    dirs, _, _ = models
    ckpt, _ = cli_round_trip
    assert (ckpt / "model" / "metadata.json").is_file() and (ckpt / "model" / ".metadata").is_file()
    copied = {p.name for p in (ckpt / "hf").iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= copied
    assert (ckpt / "hf" / "config.json").read_bytes() == (dirs["qwen2_untied"] / "config.json").read_bytes()
    assert not _leftovers(ckpt.parent)


def test_cli_round_trip_is_bit_exact(models, cli_round_trip):
    dirs, _, _ = models
    _, back = cli_round_trip
    assert _bit_differences(dirs["qwen2_untied"], back) == []
    index = json.loads((back / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all(os.path.getsize(back / f) <= 100_000 + 20_000 for f in files)  # sharded by size
    assert set(index["weight_map"]) == set(_read_folder(back))
    assert not _leftovers(back.parent)


def test_exported_folder_loads_in_transformers_with_the_same_logits(models, cli_round_trip):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dirs, tokens, reference_logits = models
    _, back = cli_round_trip
    model = AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits
    assert torch.equal(logits, reference_logits)
    text = "What is 12+30? Answer: 42"
    assert AutoTokenizer.from_pretrained(str(back))(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(str(dirs["qwen2_untied"]))(text)["input_ids"]
    assert json.loads((back / "config.json").read_text())["dtype"] == "float32"


# ------------------------------------------------------------------------------------- inside ranks (torchrun path)
def _refusal(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except ConversionError as exc:
        return str(exc)
    return None


def _ranks_job(dirs: dict, root: str, tokens: torch.Tensor, mismatched_configs: dict) -> dict:
    import torch.distributed as dist

    root_path = Path(root)
    out: dict = {"round_trips": {}, "logits": {}, "mismatch": {}}
    for name, (tp, pp) in BACK_LAYOUTS.items():
        convert_hf_to_megatron(dirs[name], root_path / f"{name}_megatron", tensor_parallel=2, pipeline_parallel=2)
        convert_megatron_to_hf(root_path / f"{name}_megatron", root_path / f"{name}_back", tensor_parallel=tp,
                               pipeline_parallel=pp)
        out["round_trips"][name] = str(root_path / f"{name}_back")

    bf16 = root_path / "qwen2_untied_bf16"
    convert_hf_to_megatron(dirs["qwen2_untied"], bf16, tensor_parallel=2, pipeline_parallel=1, dtype="bf16")
    convert_megatron_to_hf(bf16, root_path / "qwen2_untied_bf16_back")
    out["bf16"] = str(root_path / "qwen2_untied_bf16_back")

    written_tp2 = root_path / "qwen2_untied_tp2_pp1"  # world 4 → DP=2
    convert_hf_to_megatron(dirs["qwen2_untied"], written_tp2, tensor_parallel=2, pipeline_parallel=1)
    for tp, pp in [(1, 2), (2, 1)]:
        logits = checkpoint_logits(str(written_tp2 / "model"), dirs["qwen2_untied"], tokens, tp=tp, pp=pp)
        if logits is not None:
            out["logits"][(tp, pp)] = logits

    for case, (ckpt, config_dir) in {
        "missing": (root_path / "llama_untied_megatron", dirs["qwen2_untied"]),  # Qwen2 needs the QKV bias
        "unexpected": (written_tp2, dirs["llama_untied"]),  # Llama has no QKV bias
        "shape": (written_tp2, mismatched_configs["ffn64"]),
    }.items():
        target = root_path / f"mismatch_{case}"
        out["mismatch"][case] = (_refusal(convert_megatron_to_hf, ckpt, target, hf_config_from=config_dir,
                                          tensor_parallel=2, pipeline_parallel=2), target.exists())

    existing = root_path / "llama_tied_back"
    before = sorted(p.name for p in existing.iterdir())
    out["refused_existing"] = _refusal(convert_megatron_to_hf, root_path / "llama_tied_megatron", existing)
    if dist.get_rank() == 0:
        (existing / "marker").write_text("old")
    dist.barrier()
    convert_megatron_to_hf(root_path / "llama_tied_megatron", existing, force=True)
    out["forced"] = (before, sorted(p.name for p in existing.iterdir()))
    return out


@pytest.fixture(scope="module")
def ranks(models, tmp_path_factory):
    """One set of 4 spawned ranks runs :func:`_ranks_job`; the tests using it are marked slow."""
    dirs, tokens, reference_logits = models
    root = tmp_path_factory.mktemp("ranks")
    ffn64 = root / "config_ffn64"  # same model but a narrower MLP than the checkpoint holds
    ffn64.mkdir()
    config = json.loads((dirs["qwen2_untied"] / "config.json").read_text())
    (ffn64 / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    results = run_distributed(_ranks_job, 4, {k: str(v) for k, v in dirs.items()}, str(root), tokens,
                              {"ffn64": str(ffn64)}, timeout_s=900)
    merged = dict(results[0], logits={})
    for r in results:
        merged["logits"].update(r["logits"])
    return merged, root, reference_logits


@pytest.mark.slow  # 4 processes
@pytest.mark.parametrize("name", list(BACK_LAYOUTS))
def test_round_trip_tp2_pp2_is_bit_exact_for_every_model(models, ranks, name):
    dirs, _, _ = models
    results, root, _ = ranks
    assert _bit_differences(dirs[name], Path(results["round_trips"][name])) == []
    assert not _leftovers(root)


@pytest.mark.slow  # 4 processes
def test_bf16_checkpoint_round_trips_to_the_rounded_weights(models, ranks):
    dirs, _, _ = models
    results, _, _ = ranks
    original, back = _read_folder(dirs["qwen2_untied"]), _read_folder(Path(results["bf16"]))
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], tensor.to(torch.bfloat16)), name
    assert json.loads((Path(results["bf16"]) / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow  # 4 processes
def test_checkpoint_written_at_tp2_loads_at_tp1_pp2_with_the_same_logits(ranks):
    results, _, reference_logits = ranks
    assert set(results["logits"]) == {(1, 2), (2, 1)}
    for layout, logits in results["logits"].items():
        diff = (logits - reference_logits).abs().max().item()
        assert diff <= TOLERANCE, f"TP×PP={layout}: max |logit diff| vs HF {diff:.2e}"


@pytest.mark.slow  # 4 processes
def test_megatron_to_hf_names_missing_unexpected_and_misshaped_tensors(ranks):
    results, _, _ = ranks
    missing, missing_written = results["mismatch"]["missing"]
    assert missing and "missing tensors: decoder.layers.self_attention.linear_qkv.bias" in missing
    unexpected, unexpected_written = results["mismatch"]["unexpected"]
    assert unexpected and "unexpected tensors: decoder.layers.self_attention.linear_qkv.bias" in unexpected
    shape, shape_written = results["mismatch"]["shape"]
    assert shape and "decoder.layers.mlp.linear_fc2.weight: shape [4, 48, 96], expected [4, 48, 64]" in shape
    assert "decoder.layers.mlp.linear_fc1.weight" in shape and "embedding" not in shape
    assert not (missing_written or unexpected_written or shape_written)


@pytest.mark.slow  # 4 processes
def test_existing_output_is_refused_unless_forced(models, ranks):
    dirs, _, _ = models
    results, root, _ = ranks
    assert results["refused_existing"] and "already exists (pass --force" in results["refused_existing"]
    before, after = results["forced"]
    assert "marker" not in after and "model.safetensors.index.json" in before  # replaced by a fresh folder ...
    assert _bit_differences(dirs["llama_tied"], root / "llama_tied_back") == []  # ... that is complete


# ------------------------------------------------------------------------------------ bad inputs, refused up front
def _copy_model(src: Path, dst: Path, edit=None) -> Path:
    """A copy of an HF folder; ``edit(tensors)`` may change its single safetensors file."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(src / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _refused_hf_to_megatron(hf_dir: Path, out: Path, **kwargs) -> str:
    with pytest.raises(ConversionError) as info:
        convert_hf_to_megatron(hf_dir, out, tensor_parallel=2, pipeline_parallel=2, **kwargs)
    assert not out.exists() and not _leftovers(out.parent)
    return str(info.value)


def test_hf_tensor_problems_are_all_listed_by_name(models, tmp_path):
    dirs, _, _ = models

    def break_it(t):
        del t["model.layers.3.mlp.up_proj.weight"]
        t["model.layers.4.mlp.up_proj.weight"] = torch.zeros(96, 48)
        t["model.layers.2.self_attn.k_proj.weight"] = t["model.layers.2.self_attn.k_proj.weight"][:-1].clone()

    broken = _copy_model(dirs["qwen2_untied"], tmp_path / "broken", break_it)
    message = _refused_hf_to_megatron(broken, tmp_path / "out")
    assert "missing tensors: model.layers.3.mlp.up_proj.weight" in message
    assert "unexpected tensors: model.layers.4.mlp.up_proj.weight" in message
    assert "model.layers.2.self_attn.k_proj.weight in model.safetensors: shape [15, 48], expected [16, 48]" in message


def test_corrupted_safetensors_is_refused(models, tmp_path):
    dirs, _, _ = models
    truncated = _copy_model(dirs["qwen2_untied"], tmp_path / "truncated")
    size = (truncated / "model.safetensors").stat().st_size
    os.truncate(truncated / "model.safetensors", size - 100)
    assert "is truncated: tensor" in _refused_hf_to_megatron(truncated, tmp_path / "out")
    garbage = _copy_model(dirs["qwen2_untied"], tmp_path / "garbage")
    with open(garbage / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 16)
    assert "model.safetensors is corrupted" in _refused_hf_to_megatron(garbage, tmp_path / "out")


def test_index_naming_a_missing_file_is_refused(models, tmp_path):
    dirs, _, _ = models
    from safetensors import safe_open

    sharded = _copy_model(dirs["qwen2_untied"], tmp_path / "sharded")  # one file; add an index naming a second

    with safe_open(sharded / "model.safetensors", framework="pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert "model-00002-of-00002.safetensors is listed" in _refused_hf_to_megatron(sharded, tmp_path / "out")


def test_unsupported_architecture_and_impossible_layout_are_refused(models, tmp_path):
    dirs, _, _ = models
    mistral = _copy_model(dirs["llama_untied"], tmp_path / "mistral")
    config = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**config, "model_type": "mistral",
                                                     "architectures": ["MistralForCausalLM"]}))
    assert "model_type='mistral'" in _refused_hf_to_megatron(mistral, tmp_path / "out")
    with pytest.raises(ConversionError, match="num_key_value_heads=2 is not divisible by tensor_parallel=4"):
        convert_hf_to_megatron(dirs["llama_untied"], tmp_path / "out", tensor_parallel=4)


def test_existing_or_overlapping_output_is_refused(models, tmp_path):
    dirs, _, _ = models
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConversionError, match=r"already exists \(pass --force"):
        convert_hf_to_megatron(dirs["llama_tied"], tmp_path / "taken")
    assert not any((tmp_path / "taken").iterdir()) and not _leftovers(tmp_path)
    with pytest.raises(ConversionError, match="overlaps the input"):
        convert_hf_to_megatron(dirs["llama_tied"], dirs["llama_tied"] / "sub", force=True)


def test_cli_reports_bad_input_with_status_2_and_writes_nothing(models, tmp_path):
    dirs, _, _ = models
    broken = _copy_model(dirs["llama_tied"], tmp_path / "broken", lambda t: t.pop("model.norm.weight"))
    result = _cli("checkpoint_tools.hf_to_megatron", "--hf-dir", str(broken), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "hf_to_megatron: error:" in result.stderr and "missing tensors: model.norm.weight" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_broken_megatron_checkpoints_are_refused(cli_round_trip, tmp_path):
    ckpt, _ = cli_round_trip
    with pytest.raises(ConversionError, match="is not a checkpoint: expected"):
        convert_megatron_to_hf(ckpt / "hf", tmp_path / "out")
    truncated = tmp_path / "truncated"
    shutil.copytree(ckpt, truncated)
    shard = sorted((truncated / "model").glob("*.distcp"))[0]
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(ConversionError, match=rf"{shard.name} is truncated"):
        convert_megatron_to_hf(truncated, tmp_path / "out")
    no_config = tmp_path / "no_config"
    shutil.copytree(ckpt / "model", no_config / "model")
    with pytest.raises(ConversionError, match="pass --hf-config-from"):
        convert_megatron_to_hf(no_config, tmp_path / "out")
    incomplete = tmp_path / "step_000003.tmp"
    shutil.copytree(ckpt, incomplete)
    with pytest.raises(ConversionError, match="incomplete trainer checkpoint"):
        convert_megatron_to_hf(incomplete, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_run_folder_resolves_to_its_latest_complete_checkpoint(cli_round_trip, tmp_path):
    ckpt, _ = cli_round_trip
    checkpoints = tmp_path / "run" / "checkpoints"
    for step, complete in [(1, True), (2, True), (3, False)]:
        step_dir = checkpoints / f"step_{step:06d}"
        shutil.copytree(ckpt, step_dir)
        (step_dir / "trainer_state.pt").write_bytes(b"")
        if complete:
            (step_dir / "COMPLETE").write_text(f"{step}\n")
    source = resolve_checkpoint(tmp_path / "run", None)
    assert source == CheckpointSource(checkpoints / "step_000002" / "model", checkpoints / "step_000002" / "hf")
    with pytest.raises(ConversionError, match="incomplete trainer checkpoint"):
        resolve_checkpoint(checkpoints / "step_000003", None)


def test_shard_size_parsing():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1GiB") == 2**30 and parse_size("500") == 500
    with pytest.raises(ConversionError, match="not a size"):
        parse_size("lots")
