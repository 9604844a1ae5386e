"""Validation: avg@k (the paper's metric, k samples per problem, mean accuracy) or greedy accuracy (k = 1,
temperature 0: the CPU demo's held-out number). Correctness is the run's reward's ``acc`` (the built-in rule's by
default); the format bonus and the overlong penalty shape training only.

* :func:`evaluate` — the trainer's validation, on the rank that drives the rollout engine, with a sample of its
  generations for ``val_generations.jsonl`` and the loggers (the first ``eval.log_generations`` problems' first
  response: the same problems every time, so they can be read side by side across steps);
* :func:`evaluate_checkpoint` — ``dapo-megatron eval``: a saved checkpoint, with nothing built for training.

With ``rollout.tools.enabled`` a validation problem is answered as training answers it: through the multi-turn loop
(:class:`~dapo_megatron.rollout.multi_turn.MultiTurnRollout`) with the same tools, greedy or sampled as ``eval``
says; a model trained to call a tool and read its answer is scored on what it does with the tool, not on what it
writes when the tool never answers. The accuracy is then also reported split by whether a response called a tool
(``val/tools/acc/with_tool``, ``val/tools/acc/without_tool``), with ``val/tools/used_fraction``,
``val/tools/calls_per_response``, ``val/tools/failed_per_response`` and ``val/num_turns/mean``.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dapo_megatron.backend.base import Backend
from dapo_megatron.checkpoint import MODEL_DIR, load_model
from dapo_megatron.config import DAPOConfig
from dapo_megatron.data.evaluation import ScoredSample, avg_at_k
from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.policy.hf_loader import load_model_spec
from dapo_megatron.policy.model import build_model, transformer_config
from dapo_megatron.rank_zero import run_on_rank0
from dapo_megatron.reward.response_text import grouped_response_texts
from dapo_megatron.reward.scorer import RewardRequest, RewardScorer
from dapo_megatron.rollout.engine import RolloutEngine, Sample, SamplingParams
from dapo_megatron.rollout.factory import build_rollout_engine
from dapo_megatron.rollout.multi_turn import MultiTurnRollout
from dapo_megatron.tools import ToolPool
from dapo_megatron.run.model_source import initial_model_dir, load_tokenizer
from dapo_megatron.data.task import eval_prompts
from dapo_megatron.trainer.weight_sync import sync_engine_weights

EVAL_SEED = 1_234_567  # fixed: every evaluation of a run samples with the same seed, so curves are comparable


@dataclass
class Validation:
    metrics: dict[str, float]  # val/<source>/acc/mean@k, best@k
    generations: list[dict]  # data_source, index, prompt, response, ground_truth, score, acc


def evaluate(engine: RolloutEngine, records: Sequence[PromptRecord], tokenizer, config: DAPOConfig,
             reward: RewardScorer, tools: ToolPool | None = None) -> Validation:
    """``val/<source>/acc/mean@k`` (and best@k) for every data source in ``records`` and over all of them, scored
    by ``reward``, and the sample of generations; nothing when there are no records. With
    ``rollout.tools.enabled`` the responses are multi-turn, their calls run in ``tools`` (by default a pool of
    this validation's own, so its calls stay out of the training steps' tool counts)."""
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
    outputs = _generate(engine, records, tokenizer, config, params, tools)
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


def _generate(engine: RolloutEngine, records: Sequence[PromptRecord], tokenizer, config: DAPOConfig,
              params: SamplingParams, tools: ToolPool | None) -> list[list[Sample]]:
    prompts = [r.prompt_ids for r in records]
    settings = config.rollout.tools
    if not settings.enabled:
        return engine.generate(prompts, params)
    pool = tools if tools is not None else ToolPool(settings)
    try:
        loop = MultiTurnRollout(engine, tokenizer, settings, pool, max_response_length=params.max_new_tokens)
        # what a training call learns of its prompt (collectors/sync.py), never the ground truth
        metadata = [{"data_source": r.data_source, "index": r.index, "extra_info": dict(r.extra_info or {})}
                    for r in records]
        return loop.generate(prompts, params, metadata)
    finally:
        if tools is None:
            pool.close()


def _tool_split(samples: list[Sample], accs: list[bool]) -> dict[str, float]:
    """Accuracy with and without a tool call, and how the tools were used; nothing for single-turn responses."""
    uses = [(s.tool_use, bool(acc)) for s, acc in zip(samples, accs, strict=True) if s.tool_use is not None]
    if not uses:
        return {}
    count = len(uses)
    metrics = {"val/tools/used_fraction": sum(use.calls > 0 for use, _ in uses) / count,
               "val/tools/calls_per_response": sum(use.calls for use, _ in uses) / count,
               "val/tools/failed_per_response": sum(use.failed for use, _ in uses) / count,
               "val/num_turns/mean": sum(use.turns for use, _ in uses) / count}
    for name, used in (("with_tool", True), ("without_tool", False)):
        accs_of = [acc for use, acc in uses if (use.calls > 0) == used]
        if accs_of:
            metrics[f"val/tools/acc/{name}"] = sum(accs_of) / len(accs_of)
    return metrics


def evaluate_checkpoint(config: DAPOConfig, checkpoint: str | Path, backend: Backend) -> dict[str, float]:
    """Score a checkpoint's model on the config's validation prompts; every rank calls it, after
    ``init_distributed`` (on ``backend``). Builds only what that needs (:func:`checkpoint_engine`, the validation
    prompts); the run the checkpoint came from is read (its initial model's config and tokenizer), never written."""
    tokenizer = load_tokenizer(config, initial_model_dir(config))
    with tempfile.TemporaryDirectory(prefix="dapo_eval_") as scratch:
        engine = checkpoint_engine(config, checkpoint, scratch, backend)

        def on_rank0() -> dict[str, float]:
            reward = RewardScorer(config)
            try:
                return evaluate(engine, eval_prompts(config, tokenizer), tokenizer, config, reward).metrics
            finally:
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
