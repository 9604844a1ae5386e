"""A tiny Qwen2 (or Qwen3-MoE) warm-started on one tool-calling trace, for the multi-turn rollout tests.

The trace, in the fenced call format: a prompt that ends inside a python fence, the code ``print(6*7)`` and the
fence's end, the tool's answer block, then ``Answer: 42`` and EOS. In the Hermes format (``fmt="hermes"``): a prompt
ending with the assistant header, ``<tool_call>`` JSON of the same call, the tool's answer as Qwen's
``<tool_response>`` turn, then the answer. The model is trained (plain PyTorch, a few hundred Adam steps on that one
sequence, ~seconds) until greedy decoding reproduces it, so the embedded engine and an SGLang server both write the
call by themselves. The trace is built from the same pieces the rollout loop appends (the tool answer encoded on its
own), so the reference a test builds by hand is these pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tiny_models import IM_END, build_tiny_qwen2, build_tiny_tokenizer

PROMPT = "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n```python\n"
CODE = "print(6*7)"
CALL_END = "\n```\n"
ANSWER = "Answer: 42"
HERMES_PROMPT = "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n"
HERMES_CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call>'


@dataclass
class ToolTrace:
    tokenizer: object
    prompt: list[int]
    call: list[int]  # the model's first turn: the code and the fence's end
    output: list[int]  # the tool's answer as the loop appends it
    answer: list[int]  # the model's second turn, EOS included

    @property
    def response(self) -> list[int]:
        return self.call + self.output + self.answer

    @property
    def loss_mask(self) -> list[int]:
        return [1] * len(self.call) + [0] * len(self.output) + [1] * len(self.answer)

    def records(self, count: int = 1, data_source: str = "t") -> list:
        """``count`` prompt records of the trace's prompt (what a rollout generator takes)."""
        from dapo_megatron.data.prompts import PromptRecord

        return [PromptRecord(prompt_ids=tuple(self.prompt), ground_truth="42", data_source=data_source, index=i,
                             text="6*7") for i in range(count)]


def tool_trace(tokenizer, output_text: str = "42", max_output_tokens: int | None = None,
               fmt: str = "fence") -> ToolTrace:
    from dapo_megatron.config.tools import QWEN_TOOL_RESPONSE

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    answer = encode(output_text)[:max_output_tokens]
    end = [tokenizer.convert_tokens_to_ids(IM_END)]
    if fmt == "hermes":
        before, after = QWEN_TOOL_RESPONSE.split("{output}")
        return ToolTrace(tokenizer, encode(HERMES_PROMPT), encode(HERMES_CALL), encode(before) + answer + encode(after),
                         encode(ANSWER) + end)
    return ToolTrace(tokenizer, encode(PROMPT), encode(CODE + CALL_END),
                     encode("```output\n") + answer + encode("\n```\n"), encode(ANSWER) + end)


def build_tool_model(directory: str | Path, steps: int = 400, *, fmt: str = "fence", moe: bool = False) -> Path:
    """Write the warm-started model (fp32 safetensors, its tokenizer) to ``directory``: the shape and tokenizer of
    :func:`tiny_models.build_tiny_qwen2`, so its weights also load into the tests' shared SGLang server (``moe``: a
    two-layer Qwen3-MoE of :func:`tiny_qwen3.build_tiny_qwen3_folder` instead), trained on ``fmt``'s trace."""
    from transformers import AutoModelForCausalLM

    if moe:
        from tiny_qwen3 import build_tiny_qwen3_folder

        directory = build_tiny_qwen3_folder(directory, moe=True)
    else:
        directory = build_tiny_qwen2(directory)
    tokenizer = build_tiny_tokenizer(0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).train()
    trace = tool_trace(tokenizer, fmt=fmt)
    ids = torch.tensor([trace.prompt + trace.response])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(directory, safe_serialization=True)
    return directory
