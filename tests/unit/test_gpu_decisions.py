"""The GPU-path decisions, checked on CPU where no GPU runs them: FP8/sequence-parallel row alignment (packed rows and
filler micro-batches), sequence parallelism, recomputation and gradient-accumulation fusion in the TransformerConfig
arguments, the DDP overlap settings, the CUDA device and CUDA_DEVICE_MAX_CONNECTIONS, the weight-handoff route."""

from __future__ import annotations

import warnings

import pytest
import torch

from dapo_megatron.policy.model_spec import ModelSpec


def spec(**changes) -> ModelSpec:
    values = dict(arch="qwen2", vocab_size=101, hidden_size=64, num_layers=4, num_attention_heads=8, num_kv_heads=8,
                  head_dim=8, ffn_hidden_size=128, rms_norm_eps=1e-6, rope_theta=1e4, qkv_bias=True,
                  tie_embeddings=False, max_position_embeddings=256)
    return ModelSpec(**{**values, **changes})


# ------------------------------------------------------------------------------------------- defect 1: FP8 rows


@pytest.mark.parametrize("fp8_recipe, sequence_parallel, tp, expected", [
    (None, False, 8, 1),
    (None, True, 8, 8),
    ("delayed", False, 8, 16),
    ("tensorwise", False, 1, 16),
    ("mxfp8", False, 8, 32),
    ("delayed", True, 8, 16),
    ("delayed", True, 3, 48),
    ("mxfp8", True, 64, 64),
])
def test_row_multiple_is_lcm_of_fp8_alignment_and_tp_under_sp(fp8_recipe, sequence_parallel, tp, expected):
    from dapo_megatron.policy.model import row_multiple

    assert row_multiple(fp8_recipe=fp8_recipe, sequence_parallel=sequence_parallel, tensor_parallel=tp) == expected


def test_fp8_config_arguments_give_16_token_rows():
    from dapo_megatron.policy.model import row_multiple, transformer_config_arguments

    args = transformer_config_arguments(spec(), tensor_parallel=8, pipeline_parallel=1, precision="fp8",
                                        use_transformer_engine=True, cuda_available=True)
    assert args["fp8"] == "hybrid" and args["sequence_parallel"]
    multiple = row_multiple(fp8_recipe=args["fp8_recipe"], sequence_parallel=args["sequence_parallel"],
                            tensor_parallel=args["tensor_model_parallel_size"])
    assert multiple == 16


def test_fp8_alignment_pads_packed_rows_and_filler_micro_batches():
    """DP=2 where rank 0 packs one row and rank 1 two, so rank 0 adds a filler: every row a multiple of 16."""
    from dapo_megatron.policy.actor import aligned_batching
    from dapo_megatron.policy.batch_plan import PackedBatching, plan_data_parallel
    from dapo_megatron.policy.packing import PolicySample, ThdPacker

    samples = [PolicySample(torch.arange(1, 4), torch.arange(1, 1 + n)) for n in (20, 20, 18)]
    batching = aligned_batching(PackedBatching(token_budget=24), 16)
    assert batching.pad_to_multiple == 16
    assert aligned_batching(PackedBatching(token_budget=24, pad_to_multiple=4), 6).pad_to_multiple == 12
    lengths = []
    fillers = 0
    for rank in range(2):
        plan = plan_data_parallel(samples, batching, ThdPacker(), data_parallel=2, data_parallel_rank=rank)
        fillers += plan.num_empty
        lengths += [mb.tokens.shape[1] for mb in plan.micro_batches]
    assert fillers >= 1  # the filler path was exercised
    assert all(length % 16 == 0 for length in lengths), lengths
    unaligned = plan_data_parallel(samples, PackedBatching(token_budget=24), ThdPacker(), data_parallel=2,
                                   data_parallel_rank=1)
    assert any(mb.tokens.shape[1] % 16 for mb in unaligned.micro_batches)  # control: without it rows are ragged


# -------------------------------------------------------------------- defect 2: SP, recomputation, fusion flags


@pytest.mark.parametrize("requested, tp, te, expected", [
    (True, 8, True, True), (True, 1, True, False), (True, 8, False, False), (False, 8, True, False)])
def test_sequence_parallel_only_with_te_and_tp_above_one(requested, tp, te, expected):
    from dapo_megatron.policy.model import sequence_parallel_enabled

    assert sequence_parallel_enabled(requested, tensor_parallel=tp, use_transformer_engine=te) is expected


def test_transformer_config_arguments_turn_sp_and_recompute_on_for_the_te_path():
    from dapo_megatron.policy.model import transformer_config_arguments

    te = transformer_config_arguments(spec(), tensor_parallel=8, pipeline_parallel=2, precision="bf16",
                                      use_transformer_engine=True, recompute="selective", cuda_available=True)
    assert te["sequence_parallel"] is True
    assert te["recompute_granularity"] == "selective" and te["recompute_modules"] == ["core_attn"]
    local = transformer_config_arguments(spec(), tensor_parallel=8, pipeline_parallel=2,
                                         use_transformer_engine=False, recompute="full", cuda_available=False)
    assert local["sequence_parallel"] is False
    assert (local["recompute_granularity"], local["recompute_method"], local["recompute_num_layers"]) == \
        ("full", "uniform", 1)
    none = transformer_config_arguments(spec(), tensor_parallel=1, pipeline_parallel=1, use_transformer_engine=False,
                                        cuda_available=False)
    assert none["recompute_granularity"] is None
    with pytest.raises(ValueError, match="sequence_parallel needs tensor_parallel > 1"):
        transformer_config_arguments(spec(), tensor_parallel=1, pipeline_parallel=1, sequence_parallel=True,
                                     use_transformer_engine=False, cuda_available=False)


def test_megatron_accepts_the_recompute_arguments():
    from dapo_megatron.backend_registry import select_backend
    from dapo_megatron.policy.model import transformer_config

    for mode, granularity in (("selective", "selective"), ("full", "full"), ("none", None)):
        assert transformer_config(spec(), select_backend(), tensor_parallel=1, pipeline_parallel=1,
                                  recompute=mode).recompute_granularity == granularity


def test_recompute_defaults_to_selective_and_is_off_without_cuda():
    from dapo_megatron.backend_registry import select_backend
    from dapo_megatron.config import load_config

    assert load_config(None, ["model.hf_path=x", "data.train_files=[a]"]).model.recompute == "selective"
    for transformer_engine in (True, False):
        cuda = select_backend(cuda_available=True, transformer_engine=transformer_engine)
        assert cuda.recompute("selective") == "selective" and cuda.recompute("full") == "full"
    assert select_backend(cuda_available=False).recompute("selective") == "none"


def test_gradient_accumulation_fusion_needs_cuda_and_the_apex_extension(monkeypatch):
    import importlib.util

    from dapo_megatron.policy import model

    assert not model.gradient_accumulation_fusion_available(cuda_available=False)
    assert not model.gradient_accumulation_fusion_available(cuda_available=True)  # no extension on this machine
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "fused_weight_gradient_mlp_cuda" else real(name, *a))
    assert model.gradient_accumulation_fusion_available(cuda_available=True)
    assert model.transformer_config_arguments(spec(), tensor_parallel=1, pipeline_parallel=1,
                                              use_transformer_engine=False, cuda_available=True
                                              )["gradient_accumulation_fusion"]


# ------------------------------------------------------------------------------------ defect 10: overlap options


def test_ddp_config_carries_the_overlap_options():
    from dapo_megatron.policy.optimizer import ddp_config

    plain = ddp_config(use_distributed_optimizer=True)
    assert not plain.overlap_grad_reduce and not plain.overlap_param_gather and plain.grad_reduce_in_fp32
    both = ddp_config(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
    assert both.overlap_grad_reduce and both.overlap_param_gather and both.use_distributed_optimizer
    with pytest.raises(ValueError, match="distributed optimizer"):
        ddp_config(use_distributed_optimizer=False, overlap_param_gather=True)


def test_config_schema_has_the_new_keys():
    from dapo_megatron.config import ConfigError, load_config

    base = ["model.hf_path=x", "data.train_files=[a]"]
    config = load_config(None, base + ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true",
                                       "parallel.sequence_parallel=false", "model.recompute=full"])
    p = config.parallel
    assert (p.overlap_grad_reduce, p.overlap_param_gather, p.sequence_parallel) == (True, True, False)
    with pytest.raises(ConfigError, match="parallel.overlap_param_gather"):
        load_config(None, base + ["parallel.overlap_param_gather=true", "parallel.use_distributed_optimizer=false"])
    with pytest.raises(ConfigError, match="model.recompute"):
        load_config(None, base + ["model.recompute=some"])


# ------------------------------------------------------------------------- defect 9 + CUDA_DEVICE_MAX_CONNECTIONS


@pytest.mark.parametrize("local_rank, count, expected", [(0, 8, 0), (5, 8, 5), (9, 8, 1), (5, 1, 0), (3, 2, 1)])
def test_device_is_local_rank_modulo_visible_gpus(local_rank, count, expected):
    from dapo_megatron.platform import cuda_device_index

    assert cuda_device_index(local_rank, count) == expected


def test_no_visible_gpu_is_an_error():
    from dapo_megatron.platform import LaunchError, cuda_device_index

    with pytest.raises(LaunchError, match="no visible GPU"):
        cuda_device_index(0, 0)


def test_cuda_device_max_connections_only_on_gpu_with_tp():
    from dapo_megatron.platform import apply_cuda_connections, cuda_connections_setting

    assert cuda_connections_setting(2, cuda_available=True) == "1"
    assert cuda_connections_setting(1, cuda_available=True) is None
    assert cuda_connections_setting(8, cuda_available=False) is None
    env: dict = {}
    assert apply_cuda_connections(8, environ=env, cuda_available=True) == "1" and env == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    cpu_env: dict = {}
    assert apply_cuda_connections(8, environ=cpu_env, cuda_available=False) is None and cpu_env == {}
    chosen = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert apply_cuda_connections(8, environ=chosen, cuda_available=True) == "8"
    assert chosen["CUDA_DEVICE_MAX_CONNECTIONS"] == "8" and "kept as set" in str(caught[0].message)


# ------------------------------------------------------------------------------------ defect 10: handoff routes


def test_handoff_route_and_stage_sources():
    from dapo_megatron.handoff.stage_routes import choose_route, stage_sources

    assert choose_route(1, True) == "gather_to_rank0"
    assert choose_route(2, False) == "gather_to_rank0"
    assert choose_route(2, True) == "per_stage"
    assert stage_sources(64, 2) == (0, 32)  # the 32B layout: TP 8 x DP 4 ranks per stage
    assert stage_sources(4, 4) == (0, 1, 2, 3)
    with pytest.raises(ValueError):
        stage_sources(6, 4)


def test_embedded_engine_takes_one_stream_on_rank0():
    from transformers import Qwen2Config

    from dapo_megatron.rollout.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))
    assert engine.stage_stream_receiver() is None
    with pytest.raises(NotImplementedError):
        engine.commit_stage_streams(1)


# ---------------------------------------------------- MoE at TP > 1 trains only with sequence parallelism


def test_moe_training_at_tp_above_one_without_sequence_parallelism_is_refused_up_front():
    import inspect

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from dapo_megatron.config import ConfigError
    from dapo_megatron.policy.model import require_sequence_parallel_for_moe_training

    # the upstream refusal this guards against is still there (when it goes, so can the guard)
    assert "without also enabling sequence parallelism" in inspect.getsource(MoELayer.forward)
    with pytest.raises(ConfigError, match=r"parallel\.tensor=2 only with sequence parallelism.*"
                                          r"parallel\.sequence_parallel is false"):
        require_sequence_parallel_for_moe_training(has_experts=True, tensor_parallel=2, sequence_parallel=False,
                                                   use_transformer_engine=True)
    with pytest.raises(ConfigError, match="megatron's local layers"):
        require_sequence_parallel_for_moe_training(has_experts=True, tensor_parallel=2, sequence_parallel=False,
                                                   use_transformer_engine=False)
    # controls: with sequence parallelism, at TP 1, or for a dense model nothing is refused
    require_sequence_parallel_for_moe_training(has_experts=True, tensor_parallel=2, sequence_parallel=True,
                                               use_transformer_engine=True)
    require_sequence_parallel_for_moe_training(has_experts=True, tensor_parallel=1, sequence_parallel=False,
                                               use_transformer_engine=False)
    require_sequence_parallel_for_moe_training(has_experts=False, tensor_parallel=2, sequence_parallel=False,
                                               use_transformer_engine=False)


# ---------------------------------------------------- the model stage is moved to the GPU before it is wrapped


def test_a_cuda_model_stage_goes_to_the_current_gpu_and_a_stray_parameter_is_named():
    from dapo_megatron.policy.model import model_device, place_on_device

    assert model_device("cuda") == torch.device("cuda") and model_device("cpu") == torch.device("cpu")
    # what megatron leaves on the CPU on a GPU run (the router's weight, a torch norm) is moved with the rest
    stage = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    assert place_on_device(stage, torch.device("cpu")) is stage
    meta = torch.device("meta")  # a device this machine has, standing in for the GPU the check must see through to
    place_on_device(stage, meta)
    assert {parameter.device for parameter in stage.parameters()} == {meta}

    class Pinned(torch.nn.Module):
        """A module whose parameter refuses to move (``_apply`` kept from touching it), as a stray one would stay."""
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2))

        def _apply(self, fn, recurse=True):
            return self

    with pytest.raises(RuntimeError, match=r"1 parameter\(s\) are not on meta .*1\.weight \(cpu\)"):
        place_on_device(torch.nn.Sequential(torch.nn.Linear(2, 2), Pinned()), meta)


def _build_on(device_type_or_device):
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.policy.model import build_model, transformer_config

    backend = init_distributed(1, 1).backend
    tiny = spec(num_layers=2)
    return build_model(tiny, transformer_config(tiny, backend, tensor_parallel=1, pipeline_parallel=1), backend,
                       device=device_type_or_device)


def _build_devices():
    return {"on the backend's device": {str(parameter.device) for parameter in _build_on(None).parameters()},
            "on meta": {str(parameter.device) for parameter in _build_on(torch.device("meta")).parameters()}}


def test_build_model_places_every_parameter_on_the_device_it_is_given():
    from spawn_ranks import run_distributed

    # one gloo rank; "meta" stands in for the GPU: a stage built on the CPU must end up there whole
    (placed,) = run_distributed(_build_devices, 1)
    assert placed == {"on the backend's device": {"cpu"}, "on meta": {"meta"}}


def test_moe_token_permutation_is_fused_with_transformer_engine_only():
    from dapo_megatron.policy.model import moe_arguments
    from dapo_megatron.policy.model_spec import MoESpec

    moe = spec(arch="qwen3_moe", moe=MoESpec(num_experts=4, topk=2, ffn_hidden_size=32, norm_topk_prob=True))
    arguments = dict(expert_parallel=1, aux_loss_coeff=0.0, routing_replay=False)
    assert moe_arguments(moe, use_transformer_engine=True, **arguments)["moe_permute_fusion"] is True
    assert moe_arguments(moe, use_transformer_engine=False, **arguments)["moe_permute_fusion"] is False


# ---------------------------------------------------- a Transformer Engine whose PyTorch layers do not import


@pytest.fixture
def broken_transformer_engine(tmp_path, monkeypatch):
    """A ``transformer_engine`` meta package that imports while its ``pytorch`` extension does not (as the real one
    does when, e.g., cuDNN is missing: the meta package swallows that error)."""
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("try:\n    from . import pytorch\nexcept ImportError:\n    pass\n")
    (package / "pytorch.py").write_text("raise ImportError('libcudnn.so.9: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sys

    yield
    for name in [name for name in sys.modules if name.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]


def test_a_broken_transformer_engine_is_not_taken_for_a_working_one(broken_transformer_engine, caplog):
    import importlib.util
    import logging

    from dapo_megatron.cuda.backend import CudaLocalBackend
    from dapo_megatron.backend_registry import select_backend, transformer_engine_problem
    from dapo_megatron.config import ConfigError

    assert importlib.util.find_spec("transformer_engine") is not None  # what the old check looked at: "installed"
    problem = transformer_engine_problem()
    assert "transformer_engine.pytorch does not import" in problem and "libcudnn.so.9" in problem
    with pytest.raises(ConfigError, match=r"model.kernels=transformer_engine needs Transformer Engine on CUDA, and "
                                          r"transformer_engine.pytorch does not import .*libcudnn"):
        select_backend("transformer_engine", cuda_available=True)
    with caplog.at_level(logging.WARNING, logger="dapo_megatron.backend_registry"):
        fallback = select_backend("auto", cuda_available=True)
    assert isinstance(fallback, CudaLocalBackend) and "libcudnn.so.9" in caplog.text


def test_a_missing_transformer_engine_is_named_as_missing():
    from dapo_megatron.backend_registry import transformer_engine_problem

    assert "is not installed" in transformer_engine_problem()  # this machine has none (control for the test above)


def test_the_moe_sequence_parallel_refusal_is_a_config_error_before_anything_is_built():
    from dapo_megatron.backend_registry import select_backend
    from dapo_megatron.config import ConfigError, load_config
    from dapo_megatron.policy.model_spec import MoESpec
    from dapo_megatron.run.input_checks import check_training_layout

    moe = spec(arch="qwen3_moe", moe=MoESpec(num_experts=4, topk=2, ffn_hidden_size=32, norm_topk_prob=True))
    base = ["model.source=hf", "model.hf_path=/models/moe", "data.source=synthetic", "parallel.tensor=2"]
    te = select_backend("auto", cuda_available=True, transformer_engine=True)
    local = select_backend("auto", cuda_available=True, transformer_engine=False)
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel / parallel.tensor: .*parallel.tensor=2 only "
                                          r"with sequence parallelism"):
        check_training_layout(load_config(None, base + ["parallel.sequence_parallel=false"]), moe, te)
    with pytest.raises(ConfigError, match="megatron's local layers"):
        check_training_layout(load_config(None, base), moe, local)
    check_training_layout(load_config(None, base), moe, te)  # control: TE with sequence parallelism trains it


def test_a_tiny_moe_at_tp2_on_the_local_layers_is_refused_by_the_input_checks_before_the_warm_start():
    """Issue 40.10: ``model.source: tiny`` skipped the layout check, so `torchrun ... train examples/tiny_cpu_moe.yaml
    parallel.tensor=2` warm-started a model and then died with a traceback per rank in ``build_actor``."""
    from dapo_megatron.backend_registry import select_backend
    from dapo_megatron.config import ConfigError, load_config
    from dapo_megatron.run.input_checks import check_run_inputs

    base = ["model.source=tiny", "data.source=synthetic", "parallel.tensor=2", "parallel.expert=1"]
    cpu = select_backend()
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel / parallel.tensor: a mixture-of-experts model "
                                          r"trains at parallel.tensor=2 only with sequence parallelism"):
        check_run_inputs(load_config(None, base + ["model.tiny.arch=qwen3_moe"]), world_size=2, backend=cpu)
    check_run_inputs(load_config(None, base + ["model.tiny.arch=qwen3"]), world_size=2, backend=cpu)  # control
