"""Every GPU example fits its hardware: ``dapo-megatron plan`` on each, with the ``--gpu-memory-gb`` its header
documents (the README's Scale section quotes the same commands), exits 0 and says it fits — the trainer's stages and,
for colocated examples, every turn of the GPUs it shares with SGLang (``rollout/gpu_sharing.py``). And what the plan
assumes of an example holds: its longest sample fits one micro-batch and the model's context, and its header says
how to launch it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dapo_megatron.cli import main
from dapo_megatron.config import load_config
from dapo_megatron.policy.shapes import PUBLISHED_SHAPES, published_name

REPO = Path(__file__).resolve().parents[2]
PLAN_LINE = re.compile(r"^#\s+dapo-megatron plan (examples/\S+\.yaml) --gpu-memory-gb (\d+)$", re.MULTILINE)
LAUNCH_LINE = re.compile(r"^#\s+(sbatch |torchrun |dapo-megatron train )", re.MULTILINE)
GPU_EXAMPLES = sorted(path for path in (REPO / "examples").glob("*.yaml") if load_config(path).model.source == "hf")
# The hardware people have (issue 23): one 24 GB GPU, one 80 GB GPU, one node, 4 nodes, the paper's 16.
EXPECTED = {"dapo_qwen2.5_0.5b_24gb.yaml": 24, "dapo_qwen2.5_math_1.5b_1gpu.yaml": 80, "dapo_qwen2.5_7b_1node.yaml": 80,
            "dapo_qwen2.5_14b_4nodes.yaml": 80, "dapo_qwen2.5_32b.yaml": 80,
            "retool_qwen2.5_7b_instruct.yaml": 80,  # and one node with tools (issue 36)
            "lora_qwen2.5_7b_24gb.yaml": 24, "lora_qwen2.5_32b_1node.yaml": 80}  # and LoRA (issue 43)


def test_the_examples_cover_the_hardware_people_have():
    assert {path.name: _plan_command(path)[1] for path in GPU_EXAMPLES} == EXPECTED


def _plan_command(path: Path) -> tuple[str, int]:
    (match,) = PLAN_LINE.findall(path.read_text())
    assert match[0] == f"examples/{path.name}", f"{path.name}'s header plans another file: {match[0]}"
    return match[0], int(match[1])


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=lambda path: path.stem)
def test_each_example_fits_the_gpus_its_header_names(path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    relative, gpu_memory_gb = _plan_command(path)
    code = main(["plan", relative, "--gpu-memory-gb", str(gpu_memory_gb)])
    report = capsys.readouterr().out
    assert code == 0 and f"fits in {gpu_memory_gb} GB per GPU" in report, report
    config = load_config(path)
    if config.rollout.placement == "colocated":
        turns = [line for line in report.splitlines() if re.match(r"\s+\d+ (generation|training|handoff) ", line)]
        assert len(turns) == 3 * config.parallel.pipeline and all(line.split()[5] == "yes" for line in turns), report
        assert "KV cache" in report and "refuses to start" not in report


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=lambda path: path.stem)
def test_what_the_plan_assumes_of_each_example_holds(path):
    config = load_config(path)
    longest = config.data.max_prompt_length + config.rollout.max_response_length
    assert config.trainer.micro_batch_tokens >= longest  # one packed row holds the longest sample
    shape = PUBLISHED_SHAPES[published_name(config.model.hf_path)]
    assert longest <= shape["max_position_embeddings"]
    assert LAUNCH_LINE.search(path.read_text()), f"{path.name}'s header has no launch command"
    assert config.data.val_files, "validation on AIME-2024"


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=lambda path: path.stem)
def test_plan_without_the_flag_plans_for_the_gpu_the_example_names(path, capsys, monkeypatch):
    """Issue 33.5: `plan examples/dapo_qwen2.5_0.5b_24gb.yaml` answered for an 80 GB GPU unless told 24."""
    monkeypatch.chdir(REPO)
    relative, gpu_memory_gb = _plan_command(path)
    assert main(["plan", relative]) == 0
    assert f"fits in {gpu_memory_gb} GB per GPU" in capsys.readouterr().out
    assert main(["plan", relative, "--gpu-memory-gb", "40"]) in (0, 1)  # the flag still wins
    assert "in 40 GB per GPU" in capsys.readouterr().out


def test_a_colocated_example_that_does_not_fit_is_reported_so(capsys, monkeypatch):
    """The control of the fit above: the 1-GPU example without the optimizer offload runs out in the generation
    turn (its trainer table alone still fits)."""
    monkeypatch.chdir(REPO)
    code = main(["plan", "examples/dapo_qwen2.5_math_1.5b_1gpu.yaml", "rollout.offload_optimizer=false",
                 "--gpu-memory-gb", "80"])
    report = capsys.readouterr().out
    assert code == 1 and "does NOT fit in 80 GB per GPU" in report
    generation = next(line for line in report.splitlines() if " generation " in line)
    assert generation.split()[5] == "NO"
