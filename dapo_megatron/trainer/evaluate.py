"""Validation: avg@k (the paper's metric, k samples per problem, mean accuracy) or greedy accuracy (k = 1,
temperature 0: the CPU demo's held-out number). Correctness is the run's reward's ``acc`` (the built-in rule's by
default); the format bonus and the overlong penalty shape training only.

* :func:`evaluate` — the trainer's validation, on the rank that drives the rollout engine, with a sample of its
  generations for ``val_generations.jsonl`` and the loggers (the first ``eval.log_generations`` problems' first
  response: the same problems every time, so they can be read side by side across steps);
* :func:`evaluate_checkpoint` — ``dapo-megatron eval``: a saved checkpoint, with nothing built for training.

A validation problem is answered as training answers it, by the run's rollout generator
(:class:`~dapo_megatron.rollout.generator.RolloutGenerator`): with ``rollout.tools.enabled`` through the multi-turn
loop with the run's tools, greedy or sampled as ``eval`` says; a model trained to call a tool and read its answer is
scored on what it does with the tool, not on what it writes when the tool never answers. The accuracy is then also
reported split by whether a response called a tool (``val/tools/acc/with_tool``, ``val/tools/acc/without_tool``),
with the rest of training's tool-use numbers under ``val/`` (``val/tools/used_fraction``,
``val/tools/calls_per_response``, ``val/num_turns/mean``, ...:
:func:`~dapo_megatron.collectors.rollout_metrics.tool_use_metrics`).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dapo_megatron.backend.base import Backend
from dapo_megatron.checkpoint import MODEL_DIR, load_model
from dapo_megatron.collectors.rollout_metrics import tool_use_metrics
from dapo_megatron.config import DAPOConfig
from dapo_megatron.data.evaluation import ScoredSample, avg_at_k
from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.policy.hf_loader import load_model_spec
from dapo_megatron.policy.model import build_model, transformer_config
from dapo_megatron.rank_zero import run_on_rank0
from dapo_megatron.reward.response_text import grouped_response_texts
from dapo_megatron.reward.scorer import RewardRequest, RewardScorer
from dapo_megatron.rollout.engine import RolloutEngine, Sample, SamplingParams
from dapo_megatron.rollout.factory import build_rollout_engine, build_rollout_generator
from dapo_megatron.rollout.generator import RolloutGenerator
from dapo_megatron.run.model_source import initial_model_dir, load_tokenizer
from dapo_megatron.data.task import eval_prompts
from dapo_megatron.trainer.weight_sync import sync_engine_weights

EVAL_SEED = 1_234_567  # fixed: every evaluation of a run samples with the same seed, so curves are comparable


@dataclass
class Validation:
    metrics: dict[str, float]  # val/<source>/acc/mean@k, best@k
    generations: list[dict]  # data_source, index, prompt, response, ground_truth, score, acc


def evaluate(rollouts: RolloutGenerator, records: Sequence[PromptRecord], tokenizer, config: DAPOConfig,
             reward: RewardScorer) -> Validation:
    """``val/<source>/acc/mean@k`` (and best@k) for every data source in ``records`` and over all of them, generated
    by ``rollouts`` (the run's: its tools, if any, are training's; a step's tool counts are read from its own
    trajectories, so validation's calls never reach them), scored by ``reward``, and the sample of generations;
    nothing when there are no records."""
    if not records:
        return Validation({}, [])
    e = config.eval
    k = 1 if e.greedy else e.n_samples
    params = SamplingParams(
        n=k,
        temperature=0.0 if e.greedy else e.temperature,
        top_p=1.0 if e.greedy else e.top_p,
        max_new_tokens=e.max_response_length or config.rollout.max_response_length,
        stop_token_ids=(tokenizer.eos_token_id,),
        seed=EVAL_SEED,
    )
    outputs = rollouts.generate(records, params)
    responses = grouped_response_texts(tokenizer, outputs)
    outcomes = reward.score([[RewardRequest(r.data_source, text, r.ground_truth, dict(r.extra_info or {}),
                                            row=f"validation row index={r.index!r} of data source {r.data_source!r}")
                              for text in texts] for r, texts in zip(records, responses)], judged=False)
    values = [[reward.value(outcome) for outcome in group] for group in outcomes]
    scored = [ScoredSample(r.data_source, r.index, float(value.acc)) for r, group in zip(records, values)
              for value in group]
    generations = [{"data_source": r.data_source, "index": r.index, "prompt": r.text, "response": responses[i][0],
                    "ground_truth": r.ground_truth, "score": values[i][0].score, "acc": values[i][0].acc}
                   for i, r in enumerate(records[:config.eval.log_generations]) if responses[i]]
    metrics = avg_at_k(scored, k).metrics(prefix="val")
    metrics.update(_tool_split([s for group in outputs for s in group], [v.acc for group in values for v in group]))
    return Validation(metrics, generations)


def _tool_split(samples: list[Sample], accs: list[bool]) -> dict[str, float]:
    """Accuracy with and without a tool call, and how the tools were used; nothing for single-turn responses."""
    uses = [(s.tool_use, bool(acc)) for s, acc in zip(samples, accs, strict=True) if s.tool_use is not None]
    return {f"val/{key}": value for key, value in tool_use_metrics(uses).items()}


def evaluate_checkpoint(config: DAPOConfig, checkpoint: str | Path, backend: Backend) -> dict[str, float]:
    """Score a checkpoint's model on the config's validation prompts; every rank calls it, after
    ``init_distributed`` (on ``backend``). Builds only what that needs (:func:`checkpoint_engine`, the validation
    prompts); the run the checkpoint came from is read (its initial model's config and tokenizer), never written."""
    tokenizer = load_tokenizer(config, initial_model_dir(config))
    with tempfile.TemporaryDirectory(prefix="dapo_eval_") as scratch:
        engine = checkpoint_engine(config, checkpoint, scratch, backend)

        def on_rank0() -> dict[str, float]:
            reward = RewardScorer(config)
            rollouts = build_rollout_generator(config.rollout, engine, tokenizer)
            try:
                return evaluate(rollouts, eval_prompts(config, tokenizer), tokenizer, config, reward).metrics
            finally:
                rollouts.close()
                reward.close()

        try:
            return run_on_rank0(on_rank0, what="evaluation")
        finally:
            if engine is not None:
                engine.shutdown()


def checkpoint_engine(config: DAPOConfig, checkpoint: str | Path, work_dir: str | Path, backend: Backend
                      ) -> RolloutEngine | None:
    """A rollout engine (on rank 0; None elsewhere) serving ``<checkpoint>/model``, a megatron-core distributed
    checkpoint loaded at the config's TP/PP into this rank's model stage: no DDP, no optimizer. The engine keeps its
    working files (SGLang's logs and weight snapshots) under ``work_dir``."""
    model_dir = initial_model_dir(config)
    spec = load_model_spec(model_dir)
    p = config.parallel
    tconfig = transformer_config(spec, backend, tensor_parallel=p.tensor, pipeline_parallel=p.pipeline,
                                 precision=config.model.precision)
    tconfig.perform_initialization = False  # every parameter comes from the checkpoint
    model = build_model(spec, tconfig, backend)
    load_model([model], Path(checkpoint) / MODEL_DIR)
    engine = run_on_rank0(lambda: build_rollout_engine(config, model_dir, work_dir, backend),
                          what="starting the rollout engine", broadcast_result=False)
    try:
        sync_engine_weights(model, spec, engine, version=1, bucket_bytes=int(config.rollout.handoff_bucket_mb * 2**20),
                            tp_gather=backend.tp_gather)
    except BaseException:
        if engine is not None:
            engine.shutdown()
        raise
    return engine
