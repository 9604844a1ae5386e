"""LoRA adapters handed to a real SGLang 0.5.23 server on CPU (``model.lora.handoff: adapter``): two DAPO steps of the
Megatron policy with examples/tiny_cpu_sglang.yaml. The server starts with ``--enable-lora`` (which a CPU
server survives only with dapo_megatron/overrides/sglang/pinned_memory.py), takes the frozen base once and then one
adapter per step (``/load_lora_adapter_from_tensors``, ``policy_v<version>``), the requests name it, and its log-probs
agree with the policy's recomputed ones as closely as without LoRA (tests/integration/test_trainer_sglang.py's bound).
The control: the same tokens without the adapter's name get other log-probs, by more than the bound, so the bound
would catch a server that ignored the adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_harness import build_trainer, small_sglang_run

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.sglang]
# the adapters at 1e-2 (1e-3 x 10): two steps move them far enough for the control below
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.lr_multiplier=10", "optim.lr=1e-3"]


def lora_run(overrides: list[str]) -> dict | None:
    from dapo_megatron.metrics.writer import read_metrics
    from dapo_megatron.policy.lora.sizes import adapter_sizes

    trainer = build_trainer(overrides, REPO / "examples" / "tiny_cpu_sglang.yaml")
    try:
        trainer.run()
        if trainer.rank != 0:
            return None
        engine = trainer.engine
        slot = engine.pool.available()[0]
        _, models = slot.client.request("GET", "/v1/models")
        # the log-probs of the same 12 tokens with and without the adapter's name
        scored = {"input_ids": [5, 17, 33, 9, 40, 41, 42, 43, 44, 45, 46, 47],
                  "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}, "return_logprob": True,
                  "logprob_start_len": 0}
        with engine.adapters.request() as (adapter, _):
            adapted = slot.client.generate({**scored, **adapter})[0]
        base = slot.client.generate(scored)[0]
        lora = trainer.config.model.lora
        return dict(metrics=read_metrics(trainer.run_dir), models=[card["id"] for card in models["data"]],
                    held=engine.adapters.held_versions(), adapted=adapted, base=base,
                    sizes=adapter_sizes(trainer.spec, rank=lora.rank, target_modules=lora.target_modules))
    finally:
        trainer.shutdown()


def _largest_logprob_gap(one: dict, other: dict) -> float:
    """The largest difference of the two replies' log-probs of the same input tokens (the first has none)."""
    first, second = ([entry[0] for entry in reply["meta_info"]["input_token_logprobs"][1:]] for reply in (one, other))
    assert len(first) == len(second) == 11
    return max(abs(a - b) for a, b in zip(first, second))


def test_adapters_reach_the_server_and_sample_what_the_policy_computes(tmp_path):
    from spawn_ranks import run_distributed

    # TP 1 (the TP-2 gather of adapters is tests/integration/test_lora_policy.py's): one rank less to start
    (result,) = run_distributed(lora_run, 1, [*small_sglang_run(tmp_path), *LORA, "parallel.tensor=1"],
                                timeout_s=1200)
    rows = result["metrics"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    adapter_bytes = result["sizes"].handoff * 4  # fp32: the adapters alone, in PEFT's form
    for row in rows[1:]:
        assert row["rollout/weight_version"] == row["step"]
        assert row["rollout/logprob_diff/max_abs"] < 1e-3, row["rollout/logprob_diff/max_abs"]
        assert row["handoff/bytes"] == adapter_bytes  # rank 4 on a hidden size of 32: 15 % of this tiny model
        assert row["lora/handoff_fraction"] == pytest.approx(adapter_bytes / (result["sizes"].model * 4))
    # one adapter per step was loaded under its version's name; the older ones are unloaded
    assert result["held"] == [2]
    assert result["models"][1:] == ["policy_v2"]
    # the control: without the adapter the server's log-probs differ by more than the bound above
    assert _largest_logprob_gap(result["adapted"], result["base"]) > 1e-3
