"""Weights trained by the Megatron policy at TP=2 reach a real SGLang server over each transport — disk, tensor,
distributed — and the server then serves exactly them.

Two trainer ranks (TP=2, rollouts from the embedded engine) train one DAPO step per transport; after each step the
TP shards are gathered into HF tensors (the trainer's own handoff, ``DAPOTrainer.hand_off_weights``) and pushed,
through an engine attached over that transport, into the session's SGLang server (tests/sglang_fixtures.py). The
check after each push: the server reports the pushed ``weight_version`` (one past what it served before), and its
greedy output equals ``transformers``' greedy output for the very tensors pushed. The control: one more trained step
is not pushed, and the same check on the server, left on the previous weights, fails — on the version and on the
greedy tokens both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sglang_fixtures import REQUEST_TIMEOUT_S, engine_greedy, hf_greedy_until_eos
from tiny_models import load_hf_model, sample_prompts
from trainer_harness import build_trainer

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

TRANSPORTS = ("disk", "tensor", "distributed")
GREEDY_TOKENS = 12
# A large learning rate, so that one step changes greedy decoding and a stale server shows.
TRAIN = ["warm_start.enabled=false", "rollout.engine=embedded", "parallel.tensor=2", "data.synthetic.num_train=200",
         "data.synthetic.num_heldout=8", "trainer.train_batch_size=4", "trainer.mini_batch_size=2",
         "rollout.n_samples=4", "rollout.max_response_length=24", "algorithm.overlong_buffer_len=4",
         "algorithm.dynamic_sampling=false", "eval.every=0", "optim.lr=0.02", "rollout.handoff_bucket_mb=0.05"]


class RecordingEngine:
    """Stands where the trainer's engine stands during one handoff: keeps a copy of every tensor that passes and
    hands the stream on to ``engine`` (a real one), or to nobody (the control's step that is not pushed)."""

    def __init__(self, engine=None):
        self.engine = engine
        self.state: dict[str, torch.Tensor] = {}

    def update_weights(self, buckets, version: int) -> None:
        def recorded():
            for bucket in buckets:
                self.state.update((name, tensor.detach().clone()) for name, tensor in bucket)
                yield bucket

        if self.engine is None:
            for _ in recorded():
                pass
        else:
            self.engine.update_weights(recorded(), version)


def _served_now(engine, key: str, prompts) -> dict:
    from dapo_megatron.rollout.sglang.client import SGLangClient

    client = SGLangClient(engine.server_urls[0], key, 30)
    return {"served_version": int(client.served_weight_version()),
            "greedy": engine_greedy(engine, prompts, GREEDY_TOKENS)}


def _attach(url: str, key_file: str, transport: str, weight_dir: str, model_dir: str):
    from dapo_megatron.config import SGLangConfig
    from dapo_megatron.rollout.sglang.engine import SGLangEngine

    config = SGLangConfig(urls=[url], api_key_file=key_file, transport=transport, weight_dir=weight_dir,
                          request_timeout_s=REQUEST_TIMEOUT_S)
    return SGLangEngine.launch(config, model_path=model_dir, show_progress=False)


def _train_and_push(overrides: list[str], url: str, key_file: str, weight_dir: str, model_dir: str) -> list[dict]:
    """On each rank: one training step per transport, each followed by the handoff into the server over it; then one
    more step, handed to nobody. Rank 0 returns, per step, the pushed tensors and what the server served before and
    after the handoff."""
    trainer = build_trainer(overrides)
    rank0 = trainer.rank == 0
    key = Path(key_file).read_text().strip()
    prompts = sample_prompts(model_dir, 4)
    steps, server = [], None  # server: rank 0's engine attached over the current transport
    try:
        trainer.hand_off_weights(version=0)  # the embedded engine generates the training rollouts
        for step, transport in enumerate([*TRANSPORTS, None]):
            updates = trainer.train_step(step).get("actor/num_updates", 0)
            if rank0 and transport is not None:
                if server is not None:
                    server.shutdown()
                server = _attach(url, key_file, transport, weight_dir, model_dir)
            before = _served_now(server, key, prompts) if rank0 else None
            recorder = RecordingEngine(server if transport else None) if rank0 else None
            embedded, trainer.engine = trainer.engine, recorder
            try:
                trainer.hand_off_weights(version=before["served_version"] + 1 if rank0 else -1)
            finally:
                trainer.engine = embedded
            if rank0:
                steps.append({"transport": transport, "updates": updates, "before": before,
                              "after": _served_now(server, key, prompts), "pushed": recorder.state})
    finally:
        if server is not None:
            server.shutdown()
        trainer.shutdown()
    return steps


@pytest.fixture(scope="module")
def pushes(sglang_server, sglang_model_dir, tmp_path_factory) -> dict:
    from spawn_ranks import run_distributed

    (server,) = sglang_server.engine().server_processes()
    work = tmp_path_factory.mktemp("handoff_from_training")
    key_file = work / "server.key"
    key_file.write_text(server.api_key)
    overrides = [*TRAIN, "model.source=hf", f"model.hf_path={sglang_model_dir}", f"trainer.run_dir={work / 'run'}"]
    steps, _ = run_distributed(_train_and_push, 2, overrides, server.url, str(key_file), str(work / "weights"),
                               str(sglang_model_dir), timeout_s=1500)
    return {entry["transport"]: entry for entry in steps}


def serving_problems(entry: dict, model_dir: Path, prompts) -> list[str]:
    """The check after a push: empty when the server serves the pushed version and the pushed weights."""
    problems = []
    if entry["after"]["served_version"] != entry["before"]["served_version"] + 1:
        problems.append(f"serves version {entry['after']['served_version']}, "
                        f"expected {entry['before']['served_version'] + 1}")
    expected = hf_greedy_until_eos(load_hf_model(model_dir, entry["pushed"]), prompts, GREEDY_TOKENS)
    if entry["after"]["greedy"] != expected:
        problems.append(f"greedy {entry['after']['greedy']} != transformers' {expected}")
    return problems


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_trained_weights_are_served_after_the_handoff_over(pushes, transport, sglang_model_dir):
    entry = pushes[transport]
    assert entry["updates"] > 0  # the pushed weights are freshly trained ones
    previous = pushes[TRANSPORTS[TRANSPORTS.index(transport) - 1]] if transport != TRANSPORTS[0] else None
    if previous is not None:
        assert any(not torch.equal(entry["pushed"][name], previous["pushed"][name]) for name in entry["pushed"])
    assert serving_problems(entry, sglang_model_dir, sample_prompts(sglang_model_dir, 4)) == []


def test_a_server_left_on_the_previous_weights_fails_the_same_check(pushes, sglang_model_dir):
    control = pushes[None]
    assert control["updates"] > 0
    problems = serving_problems(control, sglang_model_dir, sample_prompts(sglang_model_dir, 4))
    assert len(problems) == 2, problems  # the version did not advance, and the greedy tokens are the old weights'
    assert control["after"] == control["before"]
