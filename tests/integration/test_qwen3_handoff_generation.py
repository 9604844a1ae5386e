"""Trained Qwen3 and Qwen3-MoE weights handed off from the megatron policy generate, greedily, exactly what
``transformers`` generates with them: through the embedded engine and through a real CPU SGLang server.

Two spawned ranks train a tiny model two updates with a large learning rate — Qwen3 at TP=2, Qwen3-MoE with its
experts split over both ranks (EP=2) — then hand off their shards as full HF tensors (gathered to rank 0 by the
trainer's own handoff). Those tensors go into the embedded engine and, as a versioned weight update, into an SGLang
server launched on the untrained folder. The control: the untrained weights decode differently, so equality with the
trained weights' HF output is evidence that the trained weights are the ones served.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from actor_harness import actor_settings, build_test_actor, gather_hf_weights, loss_of, random_samples
from sglang_fixtures import SERVER_PYTHON
from spawn_ranks import run_distributed
from tiny_models import hf_greedy, load_hf_model, sample_prompts
from tiny_qwen3 import build_tiny_qwen3_folder

from dapo_megatron.config import OptimConfig, SGLangConfig
from dapo_megatron.hf_format import load_hf_config
from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
from dapo_megatron.rollout.engine import RolloutError, SamplingParams
from dapo_megatron.rollout.sglang.engine import SGLangEngine
from dapo_megatron.rollout.sglang.server import require_sglang

pytestmark = pytest.mark.slow
GREEDY_TOKENS = 12
LAYOUTS = {"qwen3": (2, 1), "qwen3_moe": (1, 2)}  # (TP, EP) on 2 ranks


def _train_and_hand_off(model_dir: str, tensor_parallel: int, expert_parallel: int, vocab_size: int):
    settings = actor_settings(optim=OptimConfig(lr=0.02, adam_eps=1e-3, grad_clip=1e6, weight_decay=0.0))
    actor, spec = build_test_actor(model_dir, tensor_parallel, 1, settings, expert_parallel=expert_parallel)
    samples = random_samples(8, seed=17, vocab_size=vocab_size)
    updates = [actor.train_minibatch(samples[:4], loss_of())["skipped"],
               actor.train_minibatch(samples[4:], loss_of())["skipped"]]
    return updates, gather_hf_weights(actor, spec)


def greedy(generate, prompts) -> list[list[int]]:
    return [group[0].token_ids for group in generate(prompts, SamplingParams(n=1, temperature=0.0,
                                                                              max_new_tokens=GREEDY_TOKENS))]


def hf_model_with(model_dir: Path, tensors: dict, folder: Path):
    """``transformers``' model of ``model_dir``'s config with ``tensors`` (checkpoint names) as its weights, loaded by
    ``from_pretrained`` from a folder holding just them (its own conversion fuses a MoE layer's experts)."""
    import shutil

    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    shutil.copy(model_dir / "config.json", folder / "config.json")
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return load_hf_model(folder)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def handed_off(request, tmp_path_factory):
    family = request.param
    model_dir = build_tiny_qwen3_folder(tmp_path_factory.mktemp(family) / "hf", moe=family == "qwen3_moe")
    vocab_size = load_hf_config(model_dir).vocab_size
    (skipped, trained), _ = run_distributed(_train_and_hand_off, 2, str(model_dir), *LAYOUTS[family], vocab_size,
                                            timeout_s=900)
    assert skipped == [0.0, 0.0]
    prompts = sample_prompts(model_dir, 4)
    trained_model = hf_model_with(model_dir, trained, model_dir.parent / "trained")
    return dict(family=family, model_dir=model_dir, trained=trained, prompts=prompts,
                expected=[hf_greedy(trained_model, prompt, GREEDY_TOKENS) for prompt in prompts],
                untrained=[hf_greedy(load_hf_model(model_dir), prompt, GREEDY_TOKENS) for prompt in prompts])


def test_untrained_weights_decode_differently(handed_off):
    assert handed_off["untrained"] != handed_off["expected"]  # the control the two tests below rely on


def test_embedded_engine_generates_what_hf_generates_with_the_trained_weights(handed_off):
    engine = EmbeddedEngine(load_hf_config(handed_off["model_dir"]))
    engine.update_weights([list(handed_off["trained"].items())], version=1)
    assert greedy(engine.generate, handed_off["prompts"]) == handed_off["expected"]


@pytest.mark.sglang
def test_sglang_server_serves_the_trained_weights(handed_off, tmp_path):
    try:
        require_sglang(SERVER_PYTHON)
    except RolloutError as error:
        pytest.skip(f"SGLang is not importable by {SERVER_PYTHON}: {error}")
    config = SGLangConfig(python=SERVER_PYTHON, base_port=0, launch_timeout_s=600, request_timeout_s=60,
                          extra_server_args=["--dtype", "float32", "--max-total-tokens", "4096"])
    engine = SGLangEngine.launch(config, model_path=Path(handed_off["model_dir"]), show_progress=False,
                                 run_dir=tmp_path / "sglang")
    try:
        before = greedy(engine.generate, handed_off["prompts"])
        engine.update_weights([list(handed_off["trained"].items())], version=1)
        after = greedy(engine.generate, handed_off["prompts"])
    finally:
        engine.shutdown()
    assert before == handed_off["untrained"]  # the server started on the folder's (untrained) weights
    assert after == handed_off["expected"]
