"""Supervised warm-start on the synthetic task's reference solutions (the CPU demo only).

A randomly initialized tiny model never writes ``Answer: N``, so every group is all-wrong and DAPO has no signal.
A short supervised stage teaches the format and some arithmetic, then stops EARLY — at
``warm_start.stop_at_accuracy`` greedy accuracy on a validation slice of the training problems — because RL needs
groups with mixed outcomes (a model that is already right on every prompt leaves dynamic sampling nothing to keep).

It trains the HF-format model with plain PyTorch (AdamW, cross-entropy on the response tokens only) and measures
greedy accuracy through the rollout engine, so the reward code and the weight handoff are the ones RL uses.

On the tool task (``data.synthetic.mode: tools``) with ``rollout.tools.enabled`` the references are tool traces
(:func:`dapo_megatron.data.synthetic_tools.tool_trace`): the call, the tool's output block, ``Answer: N``, as token ids
built from the same pieces the rollout loop appends (:class:`~dapo_megatron.rollout.multi_turn.ToolCallFormat`).
The output block is the tool's text, not the model's: it is left out of the loss (as RL's loss mask leaves it out),
and validation runs through the multi-turn loop with the run's tools, so the model is scored on what it does with
the tool's real answers. With tools off the same problems are learnt as direct answers (the no-tool twin).
The RL stage then starts from the HF folder :func:`dapo_megatron.tiny_model.prepare_tiny_model` writes, through the
same HF → Megatron loader a user's checkpoint goes through.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from dapo_megatron.reward.rule import math_reward
from dapo_megatron.config import ConfigError, DAPOConfig, WarmStartConfig
from dapo_megatron.data.prompts import PromptRecord, build_prompt_records
from dapo_megatron.data.schema import validate_row
from dapo_megatron.data.synthetic import SyntheticProblem
from dapo_megatron.data.synthetic_tools import tool_trace
from dapo_megatron.data.task import synthetic_split
from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
from dapo_megatron.rollout.engine import RolloutEngine, SamplingParams
from dapo_megatron.rollout.embedded.named_tensors import checkpoint_targets
from dapo_megatron.rollout.multi_turn import MultiTurnRollout, ToolCallFormat
from dapo_megatron.tools import ToolPool, ToolResult

logger = logging.getLogger(__name__)


@dataclass
class WarmStartResult:
    steps: int
    val_accuracy: float
    seconds: float
    history: list[tuple[int, float]] = field(default_factory=list)


# A reference response as token ids, and which of them the loss trains (1) or leaves out (0: prompt, tool output).
Example = tuple[list[int], list[int]]


def greedy_accuracy(engine: RolloutEngine, records: Sequence[PromptRecord], *, tokenizer, max_new_tokens: int,
                    use_math_verify: bool = False, loop: MultiTurnRollout | None = None) -> float:
    """Fraction of ``records`` whose greedy response earns the DAPO reward; through ``loop`` (its engine is
    ``engine``) when the model uses tools."""
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                            stop_token_ids=(tokenizer.eos_token_id,), seed=0)
    prompts = [r.prompt_ids for r in records]
    outputs = engine.generate(prompts, params) if loop is None else loop.generate(prompts, params)
    correct = 0
    for record, (sample,) in zip(records, outputs):
        text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        correct += math_reward(text, record.ground_truth, use_math_verify=use_math_verify).acc
    return correct / max(len(records), 1)


def _training_examples(records: Sequence[PromptRecord], solutions: Sequence[str], tokenizer) -> list[Example]:
    """prompt + solution + eos token ids per problem, the solution and eos trained."""
    examples = []
    for record, solution in zip(records, solutions):
        response = tokenizer(solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((list(record.prompt_ids) + response, [0] * len(record.prompt_ids) + [1] * len(response)))
    return examples


def tool_trace_examples(records: Sequence[PromptRecord], problems: Sequence[SyntheticProblem], tokenizer,
                        call_format: ToolCallFormat, tool: str) -> list[Example]:
    """prompt + call + the tool's output block + ``Answer: N`` + eos per problem; the output block is not trained.
    The output block is ``call_format``'s encoding of the tool's answer, token for token what the rollout loop
    appends."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    examples = []
    for record, problem in zip(records, problems, strict=True):
        trace = tool_trace(problem)
        call = encode(call_format.call_text(tool, trace.code))
        output = call_format.output_ids(ToolResult(tool, trace.output + "\n", ok=True, kind=None, wall_s=0.0))
        answer = encode(trace.answer_line) + [tokenizer.eos_token_id]
        examples.append((list(record.prompt_ids) + call + output + answer,
                         [0] * len(record.prompt_ids) + [1] * len(call) + [0] * len(output) + [1] * len(answer)))
    return examples


def _batch_loss(model, batch: list[Example], pad_id: int) -> torch.Tensor:
    width = max(len(ids) for ids, _ in batch)
    tokens = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, trained) in enumerate(batch):
        ids_row = torch.tensor(ids)
        tokens[row, : len(ids)] = ids_row
        labels[row, : len(ids)] = torch.where(torch.tensor(trained, dtype=torch.bool), ids_row, -100)
        attention[row, : len(ids)] = 1
    logits = model(input_ids=tokens, attention_mask=attention).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def supervised_warm_start(model: torch.nn.Module, tokenizer, *, examples: Sequence[Example],
                          val_records: Sequence[PromptRecord], engine: RolloutEngine, config: WarmStartConfig,
                          max_new_tokens: int, seed: int, loop: MultiTurnRollout | None = None) -> WarmStartResult:
    """Train ``model`` in place on ``examples`` until validation greedy accuracy (through ``loop`` when given)
    reaches the target or ``max_steps`` pass."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    start = time.perf_counter()
    history: list[tuple[int, float]] = []
    accuracy = 0.0
    order: list[int] = []
    step = 0
    while step < config.max_steps:
        if len(order) < config.batch_size:
            order = list(range(len(examples)))
            rng.shuffle(order)
        batch = [examples[order.pop()] for _ in range(config.batch_size)]
        model.train()
        loss = _batch_loss(model, batch, tokenizer.pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % config.eval_every == 0 or step == config.max_steps:
            model.eval()
            engine.update_weights([[(n, p.detach()) for n, p in checkpoint_targets(model).items()]], version=step)
            accuracy = greedy_accuracy(engine, val_records, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                                       loop=loop)
            history.append((step, accuracy))
            logger.info("warm-start step %d: loss %.3f, validation greedy accuracy %.3f", step, loss.item(), accuracy)
            if accuracy >= config.stop_at_accuracy:
                break
    model.eval()
    return WarmStartResult(step, accuracy, time.perf_counter() - start, history)


def warm_start_on_synthetic_task(config: DAPOConfig, model: torch.nn.Module, tokenizer, hf_config) -> dict:
    """:func:`supervised_warm_start` on the synthetic training problems (tool traces on the tool task with tools on);
    returns the report saved with the model."""
    split = synthetic_split(config)
    n_val = min(200, len(split.train) // 10)
    # The validation slice comes from the training problems: the held-out set stays untouched until RL is scored.
    val_problems, sft_problems = split.train[:n_val], split.train[n_val:]

    def records(problems):
        rows = [validate_row(p.to_row(i, "train"), source="synthetic", row=i, integer_answers=True)
                for i, p in enumerate(problems)]
        return build_prompt_records(rows, tokenizer, max_prompt_length=config.data.max_prompt_length).records

    tools = config.rollout.tools
    with_tools = tools.enabled and config.data.synthetic.mode == "tools"
    if with_tools and not tools.code:
        raise ConfigError("rollout.tools.code: the warm-start's traces on data.synthetic.mode=tools call the python "
                          "tool; set rollout.tools.code=true (or rollout.tools.enabled=false for direct answers)")
    engine = EmbeddedEngine(hf_config)
    pool = ToolPool(tools) if with_tools else None
    try:
        if pool is not None:
            call_format = ToolCallFormat(tools, tokenizer, pool.names)
            examples = tool_trace_examples(records(sft_problems), sft_problems, tokenizer, call_format,
                                           tools.code_tool_name)
            loop = MultiTurnRollout(engine, tokenizer, tools, pool,
                                    max_response_length=config.rollout.max_response_length)
        else:
            examples = _training_examples(records(sft_problems), [p.solution for p in sft_problems], tokenizer)
            loop = None
        result = supervised_warm_start(
            model, tokenizer, examples=examples, val_records=records(val_problems), engine=engine,
            config=config.warm_start, max_new_tokens=config.rollout.max_response_length, seed=config.trainer.seed,
            loop=loop,
        )
    finally:
        if pool is not None:
            pool.close()
        engine.shutdown()
    logger.info("warm-start: %d steps, validation greedy accuracy %.3f, %.0f s",
                result.steps, result.val_accuracy, result.seconds)
    return {"steps": result.steps, "val_accuracy": result.val_accuracy, "seconds": result.seconds,
            "history": result.history}
