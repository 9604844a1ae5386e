"""Supervised warm-start on the synthetic task's reference solutions (the CPU demo only).

A randomly initialized tiny model never writes ``Answer: N``, so every group is all-wrong and DAPO has no signal.
A short supervised stage teaches the format and some arithmetic, then stops EARLY — at
``warm_start.stop_at_accuracy`` greedy accuracy on a validation slice of the training problems — because RL needs
groups with mixed outcomes (a model that is already right on every prompt leaves dynamic sampling nothing to keep).

It trains the HF-format model with plain PyTorch (AdamW, cross-entropy on the response tokens only) and measures
greedy accuracy through the rollout engine, so the reward code and the weight handoff are the ones RL uses.

On the tool task (``data.synthetic.mode: tools``) with ``rollout.tools.enabled`` the references are tool traces
(:func:`dapo_megatron.data.synthetic_tools.tool_trace`): the call, the tool's output block, ``Answer: N``, as token ids
built from the same pieces the rollout loop appends (the run's :class:`~dapo_megatron.tools.CallFormat`). The output
block is the tool's text, not the model's: it is left out of the loss (as RL's loss mask leaves it out), and
validation runs through the run's rollout generator (multi-turn, with the run's tools), so the model is scored on
what it does with the tool's real answers; ``warm_start.tool_trace_fraction`` of the problems get tool traces, the
rest direct answers (a model that does not yet call its tool every time). With tools off the same problems are learnt
as direct answers (the no-tool twin). ``warm_start.traces`` replaces the synthetic references with your own
multi-turn traces (:mod:`.traces`), validated on a slice of them.
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
from dapo_megatron.config.tools import CODE_ARGUMENT
from dapo_megatron.data.prompts import PromptRecord, build_prompt_records
from dapo_megatron.data.schema import validate_row
from dapo_megatron.data.synthetic import SyntheticProblem
from dapo_megatron.data.synthetic_tools import tool_trace
from dapo_megatron.data.task import synthetic_split
from dapo_megatron.rollout.embedded.engine import EmbeddedEngine
from dapo_megatron.rollout.engine import RolloutEngine, SamplingParams
from dapo_megatron.rollout.embedded.named_tensors import checkpoint_targets
from dapo_megatron.rollout.factory import build_rollout_generator
from dapo_megatron.rollout.generator import RolloutGenerator
from dapo_megatron.tiny_model.traces import Example, read_traces, trace_example
from dapo_megatron.tools import CallFormat, ToolResult, call_format

logger = logging.getLogger(__name__)


@dataclass
class WarmStartResult:
    steps: int
    val_accuracy: float
    seconds: float
    history: list[tuple[int, float]] = field(default_factory=list)


def greedy_accuracy(rollouts: RolloutGenerator, records: Sequence[PromptRecord], *, tokenizer, max_new_tokens: int,
                    use_math_verify: bool = False) -> float:
    """Fraction of ``records`` whose greedy response (by ``rollouts``: with the run's tools when it has them) earns
    the DAPO reward."""
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                            stop_token_ids=(tokenizer.eos_token_id,), seed=0)
    outputs = rollouts.generate(records, params)
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
                        calls: CallFormat, tool: str) -> list[Example]:
    """prompt + call + the tool's output block + ``Answer: N`` + eos per problem; the output block is not trained.
    The call is written in ``calls``' syntax and the output block is its encoding of the tool's answer, token for
    token what the rollout loop appends."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    examples = []
    for record, problem in zip(records, problems, strict=True):
        trace = tool_trace(problem)
        call = encode(calls.call_text(tool, {CODE_ARGUMENT: trace.code}))
        output = calls.output_ids(ToolResult(tool, trace.output + "\n", ok=True, kind=None, wall_s=0.0))
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
                          val_records: Sequence[PromptRecord], engine: RolloutEngine, rollouts: RolloutGenerator,
                          config: WarmStartConfig, max_new_tokens: int, seed: int) -> WarmStartResult:
    """Train ``model`` in place on ``examples`` until validation greedy accuracy (by ``rollouts``, on ``engine``,
    which receives the weights) reaches the target or ``max_steps`` pass."""
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
            accuracy = greedy_accuracy(rollouts, val_records, tokenizer=tokenizer, max_new_tokens=max_new_tokens)
            history.append((step, accuracy))
            logger.info("warm-start step %d: loss %.3f, validation greedy accuracy %.3f", step, loss.item(), accuracy)
            if accuracy >= config.stop_at_accuracy:
                break
    model.eval()
    return WarmStartResult(step, accuracy, time.perf_counter() - start, history)


def warm_start_on_synthetic_task(config: DAPOConfig, model: torch.nn.Module, tokenizer, hf_config) -> dict:
    """:func:`supervised_warm_start` on the synthetic training problems (tool traces on the tool task with tools on)
    or on ``warm_start.traces``; returns the report saved with the model."""
    tools = config.rollout.tools
    with_tools = tools.enabled and config.data.synthetic.mode == "tools" and config.warm_start.traces is None
    if with_tools and not tools.code:
        raise ConfigError("rollout.tools.code: the warm-start's traces on data.synthetic.mode=tools call the python "
                          "tool; set rollout.tools.code=true (or rollout.tools.enabled=false for direct answers)")
    calls = call_format(tools, tokenizer, [schema["name"] for schema in tools.schemas()]) if tools.enabled else None
    if config.warm_start.traces is not None:
        examples, val_records = _traces(config, tokenizer, calls)
    else:
        examples, val_records = _references(config, tokenizer, calls if with_tools else None)
    engine = EmbeddedEngine(hf_config)
    rollouts = build_rollout_generator(config.rollout, engine, tokenizer)  # the tools the run will call
    try:
        result = supervised_warm_start(
            model, tokenizer, examples=examples, val_records=val_records, engine=engine, rollouts=rollouts,
            config=config.warm_start, max_new_tokens=config.rollout.max_response_length, seed=config.trainer.seed)
    finally:
        rollouts.close()
        engine.shutdown()
    logger.info("warm-start: %d steps, validation greedy accuracy %.3f, %.0f s",
                result.steps, result.val_accuracy, result.seconds)
    return {"steps": result.steps, "val_accuracy": result.val_accuracy, "seconds": result.seconds,
            "history": result.history}


def _references(config: DAPOConfig, tokenizer, calls: CallFormat | None) -> tuple[list[Example], list[PromptRecord]]:
    """The synthetic task's reference responses (tool traces in ``calls``' syntax when given) and the validation
    slice: training problems, so the held-out set stays untouched until RL is scored."""
    split = synthetic_split(config)
    n_val = min(200, len(split.train) // 10)
    val_problems, sft_problems = split.train[:n_val], split.train[n_val:]

    def records(problems):
        rows = [validate_row(p.to_row(i, "train"), source="synthetic", row=i, integer_answers=True)
                for i, p in enumerate(problems)]
        return build_prompt_records(rows, tokenizer, max_prompt_length=config.data.max_prompt_length,
                                    system_prompt=config.rollout.tools.system_text()).records

    sft_records = records(sft_problems)
    direct = _training_examples(sft_records, [p.solution for p in sft_problems], tokenizer)
    if calls is None:
        return direct, list(records(val_problems))
    traced = tool_trace_examples(sft_records, sft_problems, tokenizer, calls, config.rollout.tools.code_tool_name)
    draw = random.Random(config.trainer.seed)  # which problems the references solve with the tool
    fraction = config.warm_start.tool_trace_fraction
    examples = [tool if draw.random() < fraction else plain for tool, plain in zip(traced, direct, strict=True)]
    return examples, list(records(val_problems))


def _traces(config: DAPOConfig, tokenizer, calls: CallFormat | None) -> tuple[list[Example], list[PromptRecord]]:
    """``warm_start.traces``: the first tenth of the traces (at most 200, at least 1) validate, the rest train."""
    traces = read_traces(config.warm_start.traces, tokenizer, max_prompt_length=config.data.max_prompt_length,
                         system_prompt=config.rollout.tools.system_text(), calls=calls)
    n_val = max(1, min(200, len(traces) // 10))
    train = traces[n_val:] or traces
    return [trace_example(t, tokenizer, calls) for t in train], [t.record for t in traces[:n_val]]
