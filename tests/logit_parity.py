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


def checkpoint_logits(ckpt_model_dir: str, hf_dir: str, tokens: torch.Tensor, *, tp: int, pp: int,
                      ep: int = 1) -> torch.Tensor | None:
    """Inside a rank of a TP×PP(×EP) job: logits [B, T, V] of the megatron checkpoint ``ckpt_model_dir`` of the HF
    model ``hf_dir``, on the one reporting rank (last stage, TP and DP rank 0); None on the others."""
    from megatron.core import parallel_state

    from dapo_megatron.checkpoint import load_model
    from dapo_megatron.platform import init_distributed, seed_everything
    from dapo_megatron.policy.hf_loader import load_model_spec
    from dapo_megatron.policy.model import build_model, transformer_config

    backend = init_distributed(tp, pp, expert_parallel=ep).backend
    seed_everything(0)  # registers megatron's model-parallel RNG streams, which the forward pass forks
    spec = load_model_spec(hf_dir)
    tconfig = transformer_config(spec, backend, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
    model = build_model(spec, tconfig, backend).eval()
    load_model([model], ckpt_model_dir)
    logits = megatron_logits(model, tokens, tconfig)
    reporter = (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_data_parallel_rank() == 0)
    result = logits[..., : spec.vocab_size].clone() if reporter else None
    parallel_state.destroy_model_parallel()
    return result
