"""LoRA on the megatron policy (dapo_megatron/policy/lora/adapter.py): the adapters' gradients are the chain rule's,
TP 2 trains exactly what TP 1 trains, the base never moves and holds no training state, the adapters' sizes are what
``plan`` and the logged fractions assume, and bf16 adapters keep fp32 main copies.

Every job builds the actor from one tiny Qwen2 checkpoint (tests/actor_harness.py) with rank-4 adapters on every
linear, takes three DAPO updates on the same samples and reports losses, gradient norms, log-probs, the adapters
gathered as PEFT tensors (dapo_megatron/handoff/adapter.py) and the HF weights of the base before and after.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from actor_harness import actor_settings, build_test_actor, gather_hf_weights, loss_of, random_samples, \
    write_tiny_qwen2
from spawn_ranks import run_distributed

pytestmark = pytest.mark.slow  # spawned ranks: 2 spawns

RANK, ALPHA, UPDATES = 4, 8.0, 3


def lora_settings(*, enabled: bool = True, precision: str = "fp32", distributed_optimizer: bool = False,
                  overlap: bool = False) -> dict:
    from dapo_megatron.config import LoRAConfig, ModelConfig, OptimConfig, ParallelConfig

    # Adam's eps near the gradients' scale and no clipping, as tests/integration/test_policy_actor.py: the update then
    # shows a wrong gradient instead of reducing it to lr·sign(g)
    return actor_settings(model=ModelConfig(precision=precision, lora=LoRAConfig(enabled=enabled, rank=RANK,
                                                                                   alpha=ALPHA)),
                          optim=OptimConfig(lr=1e-2, adam_eps=1e-3, grad_clip=1e6),
                          parallel=ParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                                  overlap_grad_reduce=overlap, overlap_param_gather=overlap),
                          temperature=0.9)


def training_job(hf_dir: str, tp: int, settings: dict) -> dict:
    from dapo_megatron.handoff.adapter import gather_adapter_to_rank0
    from dapo_megatron.policy.lora.sizes import adapter_sizes
    from dapo_megatron.policy.optimizer import training_state_bytes

    samples = random_samples(8, seed=11)
    actor, spec = build_test_actor(hf_dir, tp, 1, settings)
    base_before = gather_hf_weights(actor, spec)
    logprobs_before = actor.compute_logprobs(samples).logprobs
    metrics = [actor.train_minibatch(samples, loss_of()) for _ in range(UPDATES)]
    adapter = gather_adapter_to_rank0(actor.model, spec, rank=RANK, alpha=ALPHA, tp_gather=actor.backend.tp_gather)
    lora = settings["model"].lora
    trained = [p for p in actor.model.module.parameters() if p.requires_grad]
    return dict(metrics=metrics, logprobs_before=logprobs_before, logprobs=actor.compute_logprobs(samples).logprobs,
                adapter=None if adapter is None else adapter.tensors, base_before=base_before,
                base_after=gather_hf_weights(actor, spec), state=training_state_bytes(actor.model, actor.optimizer),
                trained_elements=sum(p.numel() for p in trained), trained_dtypes={str(p.dtype) for p in trained},
                all_elements=sum(p.numel() for p in actor.model.module.parameters()),
                weight_decays={group["weight_decay"] for group in actor.optimizer.param_groups if group["params"]},
                sizes=adapter_sizes(spec, rank=lora.rank, target_modules=lora.target_modules) if lora.enabled else None)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(write_tiny_qwen2(tmp_path_factory.mktemp("lora") / "hf", num_layers=2))


def gradient_job(hf_dir: str) -> list[dict]:
    """Per adapter: its ``A`` and ``B`` gradients and the ones the merged weight implies. The adapters are added
    to the output of the base linear ``W``, so with ``G = dL/dW`` (the base unfrozen for this job only) the chain rule
    gives ``dL/dB = s G Aᵀ`` and ``dL/dA = s Bᵀ G``. ``B`` is drawn non-zero so that ``A`` has a gradient."""
    from dapo_megatron.policy.lora.adapter import LoRAAdapter

    actor, _ = build_test_actor(hf_dir, 1, 1, lora_settings())
    model = actor.model.module
    adapters = [module for module in model.modules() if isinstance(module, LoRAAdapter)]
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for adapter in adapters:
            adapter.lora_b.copy_(0.05 * torch.randn(adapter.lora_b.shape, generator=generator))
            adapter.base_weight.requires_grad_(True)
    tokens = torch.randint(0, 100, (1, 16), generator=generator)
    logits = model(tokens, torch.arange(16)[None], None)
    (logits * torch.randn(logits.shape, generator=generator)).sum().backward()

    def gradient(parameter):  # megatron's DDP accumulates the trained parameters' gradients in main_grad
        return parameter.main_grad if getattr(parameter, "main_grad", None) is not None else parameter.grad

    rows = []
    for adapter in adapters:
        weight_grad, a, b = adapter.base_weight.grad, adapter.lora_a.detach(), adapter.lora_b.detach()
        rows.append(dict(key=adapter.key, scale=adapter.scale, grad_a=gradient(adapter.lora_a).clone(),
                         grad_b=gradient(adapter.lora_b).clone(), want_a=adapter.scale * b.T @ weight_grad,
                         want_b=adapter.scale * weight_grad @ a.T, a=a.clone(), weight_grad=weight_grad.clone()))
    return rows


def released_base_checkpoint_job(hf_dir: str) -> dict:
    """A checkpoint saved and loaded while the frozen base is released (colocated on a GPU, between updates:
    trainer/colocation.py's FrozenWeights; here on CPU tensors): the adapters come back, the base is left as it was."""
    import tempfile

    from dapo_megatron.checkpoint.save_load import load_model, model_sharded_state_dict, save_model
    from dapo_megatron.policy.lora.adapter import LoRAAdapter
    from dapo_megatron.trainer.colocation import FrozenWeights

    actor, _ = build_test_actor(hf_dir, 1, 1, lora_settings())
    actor.train_minibatch(random_samples(8, seed=11), loss_of())
    model = actor.model.module
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    frozen = FrozenWeights(actor.model)
    base_shapes = [p.shape for p in frozen.parameters]
    frozen.release()
    try:  # the control: megatron's sharded state dict reads the base's shapes, which a released base has lost
        model_sharded_state_dict([actor.model])
        unkept = None
    except Exception as error:
        unkept = f"{type(error).__name__}: {error}"
    directory = tempfile.mkdtemp(prefix="lora_released_")
    with frozen.shapes_kept():
        save_model([actor.model], directory)
    with torch.no_grad():
        for adapter in (m for m in model.modules() if isinstance(m, LoRAAdapter)):
            adapter.lora_b.zero_()
    with frozen.shapes_kept():
        load_model([actor.model], directory)
    released_sizes = {p.numel() for p in frozen.parameters}
    frozen.restore()
    return dict(unkept=unkept, released_sizes=released_sizes,
                adapters_back=all(torch.equal(p, adapters[n]) for n, p in model.named_parameters() if p.requires_grad),
                base_back=[p.shape for p in frozen.parameters] == base_shapes)


def world_one_job(hf_dir: str) -> dict:
    """Every TP-1 job in one spawned process (each spawn pays megatron's import again)."""
    return dict(lora=training_job(hf_dir, 1, lora_settings()), control=training_job(hf_dir, 1, lora_settings(
        enabled=False)), bf16=training_job(hf_dir, 1, lora_settings(precision="bf16", distributed_optimizer=True)),
        gradients=gradient_job(hf_dir), released=released_base_checkpoint_job(hf_dir))


@pytest.fixture(scope="module")
def world_one(hf_dir):
    return run_distributed(world_one_job, 1, hf_dir)[0]


@pytest.fixture(scope="module")
def tp1(world_one):
    return world_one["lora"]


def moe_job(moe_dir: str) -> dict:
    """Qwen3-MoE (6 experts, top 2) at EP 2: each rank holds 3 experts, each with its adapters."""
    from megatron.core import parallel_state

    from dapo_megatron.handoff.adapter import gather_adapter_to_rank0
    from dapo_megatron.policy.lora.sizes import adapter_sizes

    parallel_state.destroy_model_parallel()  # the dense job's TP 2 layout, in the same processes
    actor, spec = build_test_actor(moe_dir, 1, 1, lora_settings(), expert_parallel=2)
    base_before = gather_hf_weights(actor, spec)
    metrics = actor.train_minibatch(random_samples(8, seed=11), loss_of())
    adapter = gather_adapter_to_rank0(actor.model, spec, rank=RANK, alpha=ALPHA, tp_gather=actor.backend.tp_gather)
    base_after = gather_hf_weights(actor, spec)
    lora = lora_settings()["model"].lora
    return dict(metrics=metrics, adapter=None if adapter is None else adapter.tensors,
                base_moved=None if base_before is None else [n for n in base_before
                                                             if not torch.equal(base_before[n], base_after[n])],
                handoff=adapter_sizes(spec, rank=RANK, target_modules=lora.target_modules).handoff)


def tp2_job(hf_dir: str, moe_dir: str) -> dict:
    """Every two-rank job in one spawn: the dense model at TP 2, the MoE model at EP 2, and the dense model at DP 2
    with the distributed optimizer, its communication overlapped or not."""
    return dict(dense=training_job(hf_dir, 2, lora_settings()), moe=moe_job(moe_dir),
                **{f"dp2_overlap_{overlap}": dp2_job(hf_dir, overlap=overlap == "on") for overlap in ("off", "on")})


def dp2_job(hf_dir: str, *, overlap: bool) -> dict:
    """The dense model at DP 2 with the distributed optimizer, its gradient reduction and parameter gathers
    overlapped with compute or not."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # the layout of the job before, in the same processes
    return training_job(hf_dir, 1, lora_settings(distributed_optimizer=True, overlap=overlap))


@pytest.fixture(scope="module")
def two_ranks(hf_dir, tmp_path_factory):
    from tiny_qwen3 import build_tiny_qwen3_folder

    moe_dir = str(build_tiny_qwen3_folder(tmp_path_factory.mktemp("lora_moe") / "hf", moe=True))
    return run_distributed(tp2_job, 2, hf_dir, moe_dir)


@pytest.fixture(scope="module")
def tp2(two_ranks):
    return [rank["dense"] for rank in two_ranks]


def test_tp2_trains_the_same_adapters_with_the_same_loss_as_tp1(tp1, tp2):
    for rank in tp2:
        for got, want in zip(rank["metrics"], tp1["metrics"]):
            assert got["pg_loss"] == pytest.approx(want["pg_loss"], rel=1e-5, abs=1e-7)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        for got, want in zip(rank["logprobs"], tp1["logprobs"]):
            np.testing.assert_allclose(got, want, atol=1e-5)
    assert tp2[1]["adapter"] is None  # gathered on rank 0
    assert tp2[0]["adapter"].keys() == tp1["adapter"].keys()
    for name, want in tp1["adapter"].items():
        np.testing.assert_allclose(tp2[0]["adapter"][name], want, atol=1e-6, err_msg=name)
    # the losses are not all alike: training moved the adapters
    assert len({round(m["pg_loss"], 6) for m in tp1["metrics"]}) == UPDATES
    assert all(tensor.any() for name, tensor in tp1["adapter"].items() if "lora_B" in name)


def test_dp2_with_overlapped_parameter_gathers_trains_what_one_rank_trains(tp1, two_ranks):
    """The distributed optimizer's overlapped all-gather of the updated adapters is waited for in the forward
    pre-hook megatron's DDP puts on the adapter module, so every update after the first runs on the whole adapter
    (the control for the overlap: right after a step each rank holds its own shard only, as
    tests/integration/test_policy_parallel_features.py shows for full weights)."""
    for overlap in ("off", "on"):
        for rank in two_ranks:
            run = rank[f"dp2_overlap_{overlap}"]
            for update, (got, want) in enumerate(zip(run["metrics"], tp1["metrics"])):
                assert got["pg_loss"] == pytest.approx(want["pg_loss"], rel=1e-5, abs=1e-7), (overlap, update)
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (overlap, update)
        for name, want in tp1["adapter"].items():
            np.testing.assert_allclose(two_ranks[0][f"dp2_overlap_{overlap}"]["adapter"][name], want, atol=1e-6,
                                       err_msg=f"overlap {overlap}: {name}")


def test_a_checkpoint_saves_and_loads_the_adapters_while_the_base_is_released(world_one):
    run = world_one["released"]
    # the control: without its shapes the base breaks the checkpoint (megatron reads a split axis of every weight)
    assert run["unkept"] == "IndexError: tuple index out of range"
    assert run["released_sizes"] == {0}  # after the save and the load the base is released again
    assert run["adapters_back"] and run["base_back"]


def test_the_adapter_gradients_are_the_merged_weights_gradient_projected(world_one):
    """Backpropagation through the forward hook gives each factor the chain rule's gradient, on every linear kind
    (fused qkv, SwiGLU fc1, the row-parallel proj and fc2). Control: the same comparison with another adapter's
    ``A`` in place of its own is far off, so the tolerance would catch a gradient in the wrong direction."""
    rows = world_one["gradients"]
    assert len(rows) == 2 * 4  # 2 layers x every linear
    for row in rows:
        for factor in ("a", "b"):
            got, want = row[f"grad_{factor}"], row[f"want_{factor}"]
            assert want.norm() > 0, (row["key"], factor)
            assert (got - want).norm() <= 1e-5 * want.norm(), (row["key"], factor)
    first, other = rows[0], next(row for row in rows[1:] if row["a"].shape == rows[0]["a"].shape)
    wrong = first["scale"] * first["weight_grad"] @ other["a"].T
    assert (first["grad_b"] - wrong).norm() > 0.5 * first["want_b"].norm()


def test_the_base_never_moves_and_starts_as_the_model(tp1, tp2, world_one):
    for run in (tp1, tp2[0]):
        assert run["base_after"].keys() == run["base_before"].keys()
        assert all(torch.equal(run["base_after"][n], run["base_before"][n]) for n in run["base_before"])
    # B starts at zero: before the first update the policy is exactly the base model
    control = world_one["control"]
    for with_lora, without in zip(tp1["logprobs_before"], control["logprobs_before"]):
        assert torch.equal(with_lora, without)
    # and full fine-tuning, the control, moves the same base
    assert any(not torch.equal(control["base_after"][n], control["base_before"][n]) for n in control["base_before"])
    assert control["state"]["grad_buffers"] == control["all_elements"] * 4  # every parameter has an fp32 slot


def test_only_the_adapters_hold_gradients_and_adam_state(tp1):
    sizes = tp1["sizes"]
    assert tp1["trained_elements"] == sizes.trainable  # the formula plan and lora/trainable_fraction use
    assert sum(t.numel() for t in tp1["adapter"].values()) == sizes.handoff  # PEFT's form: what is handed off
    assert tp1["state"]["grad_buffers"] == sizes.trainable * 4  # fp32 gradient slots for the adapters only
    assert tp1["state"]["moments"] == 2 * sizes.trainable * 4  # exp_avg and exp_avg_sq
    assert tp1["state"]["main_params"] == 0  # fp32 parameters are their own main copies
    assert sizes.trainable < 0.1 * tp1["all_elements"]


def test_the_adapters_take_model_lora_weight_decay_not_the_full_models(tp1, world_one):
    """optim.weight_decay is 0.1 in every job (its default); megatron's param groups would decay every 2-D adapter
    by it. The control: full fine-tuning's matrices are decayed by it (its norms are not)."""
    assert tp1["weight_decays"] == {0.0}  # model.lora.weight_decay's default
    assert world_one["control"]["weight_decays"] == {0.0, 0.1}


def test_bf16_adapters_train_on_fp32_main_copies_with_the_distributed_optimizer(world_one):
    run = world_one["bf16"]
    assert run["trained_dtypes"] == {"torch.bfloat16"}
    assert run["state"]["main_params"] == run["sizes"].trainable * 4  # fp32 copies of the adapters, nothing else
    assert run["state"]["moments"] == 2 * run["sizes"].trainable * 4
    assert all(torch.equal(run["base_after"][n], run["base_before"][n]) for n in run["base_before"])
    assert all(np.isfinite(m["pg_loss"]) for m in run["metrics"])


def test_every_expert_of_a_moe_layer_gets_its_adapters_at_ep2(two_ranks):
    """The experts (megatron's SequentialMLP, 3 per EP rank) take adapters like dense linears: all 6 experts' are
    gathered across the EP ranks under their global index, their B moved, the base did not."""
    moe = two_ranks[0]["moe"]
    assert np.isfinite(moe["metrics"]["pg_loss"]) and moe["base_moved"] == []
    adapter = moe["adapter"]
    assert sum(t.numel() for t in adapter.values()) == moe["handoff"]
    for expert in range(6):
        b = adapter[f"base_model.model.model.layers.0.mlp.experts.{expert}.down_proj.lora_B.weight"]
        assert b.shape == (48, RANK)
    moved = [e for e in range(6) if adapter[f"base_model.model.model.layers.0.mlp.experts.{e}.gate_proj.lora_B.weight"]
             .any()]
    assert len(moved) >= 4  # top-2 of 6 over 8 samples' tokens: most experts got some, and trained
    assert two_ranks[1]["moe"]["adapter"] is None
