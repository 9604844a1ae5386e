"""Issue 33.4/33.5, the command line as users write it: overrides after ``--resume`` / ``--ckpt`` (the synopsis shows
them on either side), and ``plan`` on input it cannot plan answered in one line, not a traceback. In-process
``dapo-megatron`` (``cli.main``): these answers come before any model is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_megatron.cli import main
from dapo_megatron.user_errors import EXIT_CODES

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "examples" / "tiny_cpu.yaml")
SEVEN_B = "examples/dapo_qwen2.5_7b_1node.yaml"


def _one_line(capsys, kind: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{kind} error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv", [["train", TINY, "--resume", "rollout.n_samples=many"],
                                  ["train", TINY, "--overwrite", "trainer.seed=1", "rollout.n_samples=many"],
                                  ["eval", TINY, "--ckpt", "nowhere", "rollout.n_samples=many"],
                                  ["eval", TINY, "--ckpt", "nowhere", "--out", "x.json", "rollout.n_samples=many"]],
                         ids=["train-resume", "train-overwrite", "eval-ckpt", "eval-ckpt-out"])
def test_overrides_after_the_options_are_read(argv, capsys):
    """Before: argparse refused them (`unrecognized arguments`, exit 2 from a usage message). The bad value shows
    the override was read: the config check answers, before torch is imported."""
    assert main(argv) == EXIT_CODES["config"]
    assert _one_line(capsys, "config") == "config error: rollout.n_samples: expected an integer, got 'many'"


def test_what_is_not_an_override_after_the_options_is_still_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["train", TINY, "--resume", "trainer.seed=1", "--bogus"])
    assert refused.value.code == 2 and "unrecognized arguments: trainer.seed=1 --bogus" in capsys.readouterr().err


def test_plan_of_an_unsupported_architecture_is_the_model_error_train_gives(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    folder = tmp_path / "neox"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 100, "intermediate_size": 128}))
    assert main(["plan", SEVEN_B, f"model.hf_path={folder}"]) == EXIT_CODES["model"]
    assert _one_line(capsys, "model").startswith(f"model error: {folder}/config.json: unsupported architecture "
                                                 f"model_type='gpt_neox'")


def test_plan_with_expert_parallelism_not_dividing_the_data_parallel_size_is_a_config_error(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    moe = ["model.hf_path=models/Qwen3-30B-A3B", "parallel.expert=4"]  # a published MoE shape: 128 experts
    assert main(["plan", SEVEN_B, *moe, "--data-parallel", "6"]) == EXIT_CODES["config"]
    assert _one_line(capsys, "config") == ("config error: parallel.expert: 4 expert-parallel ranks must divide the "
                                           "data-parallel size, 6 (--data-parallel)")
    assert main(["plan", SEVEN_B, *moe, "--data-parallel", "8"]) in (0, 1)  # the control: a layout it plans
    assert "layout: TP" in capsys.readouterr().out
