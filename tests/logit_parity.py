"""Logits of a megatron ``GPTModel`` the way the parity tests compare them with HF ``transformers``."""

from __future__ import annotations

import torch

TOLERANCE = 1e-5  # fp32 logits: megatron at any TP×PP layout vs transformers


def megatron_logits(model, tokens: torch.Tensor, tconfig) -> torch.Tensor | None:
    """Full-vocab logits [B, T, V_pad] on the last pipeline stage (gathered over TP), None on other stages."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch, positions, None)
        return output, lambda out: (out.sum() * 0.0, {"logits": out.detach()})

    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model], num_microbatches=1,
            seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return gather_from_tensor_model_parallel_region(results[0]["logits"])
