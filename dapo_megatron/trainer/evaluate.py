"""Validation: avg@k (the paper's metric, k samples per problem, mean accuracy) or greedy accuracy (k = 1,
temperature 0: the CPU demo's held-out number). Runs on the rank that drives the rollout engine."""

from __future__ import annotations

from typing import Sequence

from dapo_megatron.algorithm import math_reward
from dapo_megatron.config import DAPOConfig
from dapo_megatron.data.evaluation import avg_at_k, score_samples
from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.rollout.engine import RolloutEngine, SamplingParams

EVAL_SEED = 1_234_567  # fixed: every evaluation of a run samples with the same seed, so curves are comparable


def evaluate(engine: RolloutEngine, records: Sequence[PromptRecord], tokenizer, config: DAPOConfig) -> dict[str, float]:
    """``val/<source>/acc/mean@k`` (and best@k) for every data source in ``records`` and over all of them."""
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
    outputs = engine.generate([r.prompt_ids for r in records], params)
    responses = [[tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples] for samples in outputs]
    use_mv = config.algorithm.use_math_verify
    scored = score_samples(records, responses,
                           lambda response, truth: math_reward(response, truth, use_math_verify=use_mv).acc)
    return avg_at_k(scored, k).metrics(prefix="val")
