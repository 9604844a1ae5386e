"""The GPU check's colocated rows (:mod:`gpu_check` runs them; what rows are made of: :mod:`gpu_check_setup`): the
trainer's side of a generation turn next to SGLang servers on its own GPUs (``rollout.placement: colocated``),
without SGLang (the lent GPU machine has none).

* :func:`colocated_row` — on the dense BF16 actor of the earlier rows (distributed optimizer): the optimizer state
  (fp32 main parameters, Adam's moments) to host memory and back, in GB/s each way; the GPU memory it frees next to
  ``dapo-megatron plan``'s optimizer share; the state after the round trip bit-equal to before; an update after it
  finite and applied.
* :func:`colocated_moe_row` — a small Qwen3-MoE actor WITHOUT the distributed optimizer (megatron leaves the router
  weights and torch norms on the CPU there: the model must be moved to the GPU before wrapping), with routing replay:
  π_old's recorded routing kept in host memory (pinned), a generation turn that frees the gradient buffers and the
  optimizer state (next to ``plan``'s share of both), and a replayed update after it, finite and applied.
"""

from __future__ import annotations

import math
import time

import torch
from gpu_check_setup import CheckShapes, Row, dapo_loss, random_samples, sync


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """What megatron's offload_to_cpu moves: every optimizer's parameters (the fp32 main copies) and state tensors."""
    tensors = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        for group in inner.param_groups:
            for parameter in group["params"]:
                tensors.append(parameter)
                tensors += [value for value in inner.state.get(parameter, {}).values() if torch.is_tensor(value)]
    return tensors


def _colocated_config(*overrides: str):
    from dapo_megatron.config import load_config

    return load_config(None, ["model.source=tiny", "data.source=synthetic", "rollout.engine=sglang",
                              "rollout.placement=colocated", "rollout.sglang.transport=tensor",
                              "rollout.sglang.mem_fraction_static=0.5", "rollout.offload_optimizer=true",
                              *overrides])


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def colocated_row(shapes: CheckShapes, actor, spec, device: torch.device) -> Row:
    """Row 6: one generation turn of the trainer next to colocated servers (see the module docstring)."""
    from dapo_megatron.policy.memory.gpu import estimate_memory
    from dapo_megatron.policy.packing import PolicySample
    from dapo_megatron.trainer.colocation import Colocation

    colocation = Colocation(_colocated_config(), actor.optimizer, lambda: None, device_type=device.type)
    state = _optimizer_tensors(actor.optimizer)
    before = [t.detach().to("cpu", copy=True) for t in state]
    devices = [t.device for t in state]
    moved = sum(t.numel() * t.element_size() for t in state if t.is_cuda)  # on CPU nothing moves
    del state  # it would keep the moments' GPU storage alive: megatron replaces them in the state dicts
    sync()
    allocated = _allocated()
    started = time.perf_counter()
    with colocation.generating():
        sync()
        out_s = time.perf_counter() - started
        generating = _allocated()
        back_started = time.perf_counter()
    sync()
    back_s = time.perf_counter() - back_started
    after = _optimizer_tensors(actor.optimizer)
    exact = all(torch.equal(a.detach().cpu(), b) for a, b in zip(after, before, strict=True))
    returned = all(a.device == d for a, d in zip(after, devices) if d.type == "cuda")
    # megatron's restore_from_cpu moves every non-CUDA tensor to the GPU: torch AdamW's CPU step counters too
    promoted = sum(d.type == "cpu" and a.device.type == "cuda" for a, d in zip(after, devices))
    samples = random_samples(shapes.samples, spec.vocab_size, shapes.prompt_tokens, shapes.response_tokens, seed=3)
    logprobs = actor.compute_logprobs(samples).logprobs
    update = actor.train_minibatch([PolicySample(s.prompt_ids, s.response_ids, s.advantage, old_logprobs=lp)
                                    for s, lp in zip(samples, logprobs)], dapo_loss())
    (stage,) = estimate_memory(spec, tensor_parallel=1, pipeline_parallel=1, data_parallel=1,
                               micro_batch_tokens=shapes.token_budget)
    freed = allocated - generating
    out_gbps, back_gbps = moved / max(out_s, 1e-9) / 1e9, moved / max(back_s, 1e-9) / 1e9
    ok = exact and returned and math.isfinite(update["grad_norm"]) and not update["skipped"]
    return Row("colocated turn: optimizer state to host and back", "ok" if ok else "FAILED",
               f"{moved / 1e9:.3g} GB out at {out_gbps:.3g} GB/s, back at {back_gbps:.3g} GB/s; GPU memory freed "
               f"{freed / 1e9:.3g} GB (plan's optimizer share {stage.optimizer_bytes / 1e9:.3g} GB); allocated while "
               f"generating {generating / 1e9:.3g} GB (plan's weights + gradients "
               f"{(stage.params_bytes + stage.grads_bytes) / 1e9:.3g} GB); state round trip "
               f"{'exact' if exact and returned else 'CHANGED'}, {promoted} CPU tensor(s) came back on the GPU; next "
               f"update grad norm {update['grad_norm']:.4g}",
               {"moved_gb": moved / 1e9, "out_gbps": out_gbps, "back_gbps": back_gbps, "freed_gb": freed / 1e9,
                "planned_optimizer_gb": stage.optimizer_bytes / 1e9, "generating_gb": generating / 1e9,
                "planned_weights_grads_gb": (stage.params_bytes + stage.grads_bytes) / 1e9,
                "round_trip_exact": float(exact and returned), "promoted_to_gpu": float(promoted),
                "grad_norm": update["grad_norm"]})


def moe_spec(shapes: CheckShapes):
    """A two-layer Qwen3-MoE (tiny under ``--tiny``), the MoE rows' model."""
    from dapo_megatron.policy.model_spec import model_spec_from_hf
    from dapo_megatron.policy.shapes import published_hf_config

    tiny = shapes.parity_model.get("hidden_size", 0) < 256
    changes = (dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, vocab_size=384,
                    max_position_embeddings=512, bos_token_id=0, eos_token_id=0) if tiny else
               dict(num_experts=32, vocab_size=32768))
    return model_spec_from_hf(published_hf_config("Qwen3-30B-A3B", num_hidden_layers=2, **changes))


def colocated_moe_row(shapes: CheckShapes, device: torch.device) -> Row:
    """Row 7: a Qwen3-MoE stage without the distributed optimizer, routing replayed, through a generation turn."""
    from dapo_megatron.config import ModelConfig, OptimConfig, ParallelConfig
    from dapo_megatron.backend_registry import select_backend
    from dapo_megatron.policy.actor import build_actor
    from dapo_megatron.policy.memory.gpu import estimate_memory
    from dapo_megatron.policy.packing import PolicySample
    from dapo_megatron.trainer.colocation import Colocation

    spec = moe_spec(shapes)
    # no distributed optimizer: the parameters megatron builds on the CPU must be moved to the GPU before wrapping
    actor = build_actor(spec, backend=select_backend("auto"), model=ModelConfig(precision="bf16"),
                        parallel=ParallelConfig(use_distributed_optimizer=False),
                        optim=OptimConfig(lr=1e-4, warmup_steps=0), routing_replay=True,
                        micro_batch_tokens=shapes.token_budget, temperature=1.0)
    stray = sorted({str(p.device) for p in actor.model.parameters()} - {str(torch.device(device.type, 0)),
                                                                          str(device)})
    samples = random_samples(shapes.samples, spec.vocab_size, shapes.prompt_tokens, shapes.response_tokens, seed=4)
    old = actor.compute_logprobs(samples, record_routing=True)
    recorded = [indices for router in old.routing.per_router for indices in router]
    on_host = all(t.device.type == "cpu" for t in recorded)
    pinned = all(t.is_pinned() for t in recorded) if device.type == "cuda" else True
    colocation = Colocation(_colocated_config("rollout.offload_optimizer=true"), actor.optimizer, lambda: None,
                            device_type=device.type, model=actor.model)
    sync()
    allocated = _allocated()
    with colocation.generating():
        sync()
        generating = _allocated()
    sync()
    update = actor.train_minibatch([PolicySample(s.prompt_ids, s.response_ids, s.advantage, old_logprobs=lp)
                                    for s, lp in zip(samples, old.logprobs)], dapo_loss(), routing=old.routing)
    (stage,) = estimate_memory(spec, tensor_parallel=1, pipeline_parallel=1, data_parallel=1,
                               micro_batch_tokens=shapes.token_budget, distributed_optimizer=False)
    planned = stage.grads_bytes + stage.optimizer_bytes
    freed = allocated - generating
    ok = (not stray and on_host and pinned and math.isfinite(update["grad_norm"]) and not update["skipped"])
    return Row("colocated MoE turn: no distributed optimizer, routing replayed", "ok" if ok else "FAILED",
               f"parameters off the device: {', '.join(stray) or 'none'}; recorded routing "
               f"{sum(t.numel() * t.element_size() for t in recorded) / 1e6:.3g} MB in host memory"
               f"{' (pinned)' if device.type == 'cuda' and pinned else ''}: {'yes' if on_host else 'NO'}; GPU memory "
               f"freed while generating {freed / 1e9:.3g} GB (plan's gradients + optimizer state "
               f"{planned / 1e9:.3g} GB); replayed update grad norm {update['grad_norm']:.4g}",
               {"stray_parameters": float(len(stray)), "routing_on_host": float(on_host), "freed_gb": freed / 1e9,
                "planned_grads_optimizer_gb": planned / 1e9, "grad_norm": update["grad_norm"]})
