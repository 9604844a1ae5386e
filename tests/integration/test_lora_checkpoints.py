"""A LoRA run's checkpoints (examples/tiny_cpu_lora.yaml through the CLI, as a user runs it): they hold the adapters
alone, a run SIGKILLed after its step-1 checkpoint and resumed logs exactly the metrics of the run that was not
interrupted, and ``checkpoint_tools.lora_export`` turns a checkpoint into a PEFT adapter folder that HF's ``peft``
loads onto the base with the logits of the merged export (itself the base with ``W + (alpha / r) B A`` merged on
megatron's shards), and not the base's (the control)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_runs import REPO, check_run, cli_command, kill_after_checkpoint, read_run_metrics

pytestmark = pytest.mark.slow

LORA = REPO / "examples" / "tiny_cpu_lora.yaml"
# optim.lr and the multiplier set here, whatever the example's: one step moves the adapters far enough for the controls
OVERRIDES = ["warm_start.enabled=false", "trainer.total_steps=2", "trainer.save_every=1",
             "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.n_samples=4",
             "data.synthetic.num_train=200", "data.synthetic.num_heldout=8", "eval.every=0",
             "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4", "algorithm.dynamic_sampling=false",
             "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
             "optim.lr=1e-3", "model.lora.lr_multiplier=10"]


def _train(run_dir: Path) -> list[str]:
    return ["train", str(LORA), *OVERRIDES, f"trainer.run_dir={run_dir}"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("lora_run") / "straight"
    check_run(*_train(run_dir))
    return run_dir


def test_sigkill_then_resume_logs_identical_metrics(straight, tmp_path):
    killed = tmp_path / "killed"
    kill_after_checkpoint(cli_command(*_train(killed)), killed, step=1)
    assert not (killed / "checkpoints" / "step_000002").exists()
    check_run(*_train(killed), "--resume")
    assert read_run_metrics(killed) == read_run_metrics(straight)
    assert [row["step"] for row in read_run_metrics(killed)] == [0, 1, 2]


def test_a_checkpoint_holds_the_adapters_alone(straight):
    from torch.distributed.checkpoint import FileSystemReader

    from dapo_megatron.policy.lora.names import is_adapter_parameter

    stored = FileSystemReader(str(straight / "checkpoints" / "step_000002" / "model")).read_metadata()
    keys = list(stored.state_dict_metadata)
    assert keys and all(is_adapter_parameter(key) for key in keys), keys
    # one tensor per module, its layers stacked (megatron's layer axis): qkv, proj, fc1, fc2
    assert sorted(key.removeprefix("decoder.layers.") for key in keys if key.endswith("lora_a")) == [
        "mlp.linear_fc1_lora.lora_a", "mlp.linear_fc2_lora.lora_a", "self_attention.linear_proj_lora.lora_a",
        "self_attention.linear_qkv_lora.lora_a"]


def test_megatron_to_hf_names_the_tool_for_an_adapter_checkpoint(straight, tmp_path):
    """Checked before any rank starts (the CLI prints the ConversionError as its one error line, exit 2)."""
    from checkpoint_tools.errors import ConversionError
    from checkpoint_tools.megatron_to_hf import plan_megatron_to_hf

    with pytest.raises(ConversionError, match="holds LoRA adapters alone.*checkpoint_tools.lora_export"):
        plan_megatron_to_hf(straight / "checkpoints" / "step_000002", tmp_path / "hf")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def test_the_peft_export_loads_in_peft_with_the_merged_models_logits(straight, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = straight / "checkpoints" / "step_000002"
    check_run("--ckpt", str(ckpt), "--out", str(tmp_path / "peft"), module="checkpoint_tools.lora_export")
    check_run("--ckpt", str(ckpt), "--out", str(tmp_path / "merged"), "--merged",
              module="checkpoint_tools.lora_export")
    base_dir = straight / "initial_model"
    ids = torch.randint(3, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    base = _logits(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), ids)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                        tmp_path / "peft")
    merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32), ids)
    assert adapted.peft_config["default"].r == 4 and adapted.peft_config["default"].lora_alpha == 32
    torch.testing.assert_close(_logits(adapted, ids), merged, atol=1e-5, rtol=1e-5)
    assert (merged - base).abs().max() > 1e-3  # the control: the adapter changes the logits
