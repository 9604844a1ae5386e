"""The pieces of LoRA that need no megatron process: the ``model.lora`` section, PEFT's names and format, the adapters'
HF mapping at TP 2 (exported ``B`` rows belong to the rows of ``W`` they change), the sizes ``plan`` and the logged
fractions use, the embedded engine's merge, and the SGLang adapter books (which adapter requests name, when an old one
is unloaded)."""

from __future__ import annotations

import threading

import pytest
import torch

from dapo_megatron.config import ConfigError, LoRAConfig, load_config
from dapo_megatron.hf_format import HFFormatError
from dapo_megatron.hf_format.peft_adapter import PeftAdapter, base_weight_name, peft_name, read_peft_adapter, \
    write_peft_adapter
from dapo_megatron.policy.lora.sizes import adapter_sizes
from dapo_megatron.policy.model_spec import model_spec_from_hf
from dapo_megatron.policy.shapes import published_hf_config


@pytest.mark.parametrize("override, key", [
    ("model.lora.rank=0", "model.lora.rank"), ("model.lora.alpha=0", "model.lora.alpha"),
    ("model.lora.dropout=1.0", "model.lora.dropout"), ("model.lora.lr_multiplier=-1", "model.lora.lr_multiplier"),
    ("model.lora.weight_decay=-0.1", "model.lora.weight_decay"),
    ("model.lora.target_modules=[q_proj]", "model.lora.target_modules"),
    ("model.lora.target_modules=[]", "model.lora.target_modules"), ("model.lora.handoff=full", "model.lora.handoff"),
])
def test_a_bad_lora_setting_is_one_error_naming_its_key(override, key):
    with pytest.raises(ConfigError) as error:
        load_config("examples/tiny_cpu_lora.yaml", [override])
    assert str(error.value).startswith(key) and "\n" not in str(error.value)


def test_lora_is_off_by_default_and_the_example_turns_it_on():
    assert not load_config("examples/tiny_cpu.yaml").model.lora.enabled
    lora = load_config("examples/tiny_cpu_lora.yaml").model.lora
    assert (lora.enabled, lora.rank, lora.scale, lora.lr_multiplier, lora.weight_decay) == (True, 4, 8.0, 5.0, 0.0)
    assert lora.target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def test_peft_names_round_trip():
    name = peft_name("model.layers.3.self_attn.q_proj.weight", "A")
    assert name == "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
    assert base_weight_name(name) == ("model.layers.3.self_attn.q_proj.weight", "A")
    with pytest.raises(HFFormatError, match="not a PEFT LoRA tensor name"):
        base_weight_name("model.layers.3.self_attn.q_proj.weight")
    with pytest.raises(ValueError):
        peft_name("model.layers.3.self_attn.q_proj.bias", "A")


def _adapter(shapes: dict[str, tuple[int, int]], rank: int = 2, seed: int = 0) -> PeftAdapter:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for base, (out, inp) in shapes.items():
        tensors[peft_name(base, "A")] = torch.randn(rank, inp, generator=generator)
        tensors[peft_name(base, "B")] = torch.randn(out, rank, generator=generator)
    return PeftAdapter(tensors, rank=rank, alpha=4.0)


def test_an_adapter_folder_round_trips_and_bad_adapters_are_refused(tmp_path):
    adapter = _adapter({"model.layers.0.mlp.down_proj.weight": (8, 16), "model.layers.0.self_attn.q_proj.weight":
                        (16, 8)})
    folder = write_peft_adapter(tmp_path / "adapter", adapter)
    again = read_peft_adapter(folder)
    assert (again.rank, again.alpha, again.target_modules) == (2, 4.0, ["down_proj", "q_proj"])
    assert all(torch.equal(again.tensors[n], t) for n, t in adapter.tensors.items())
    unpaired = dict(adapter.tensors)
    unpaired.pop(peft_name("model.layers.0.mlp.down_proj.weight", "B"))
    with pytest.raises(HFFormatError, match="without both lora_A and lora_B"):
        PeftAdapter(unpaired, rank=2, alpha=4.0)
    with pytest.raises(HFFormatError, match="r = 3"):
        PeftAdapter(adapter.tensors, rank=3, alpha=4.0)
    with pytest.raises(HFFormatError, match="not a PEFT adapter folder"):
        read_peft_adapter(tmp_path)


def test_exported_b_rows_change_the_rows_of_w_they_belong_to_at_tp2():
    """Merged on megatron's TP shards (``W_r + B_r A``, what the trainer computes) and exported by the weights'
    mapping equals the base exported by it plus ``B_i A`` with ``B_i`` exported by the adapters' mapping — for the
    per-group QKV layout and for the gate/up halves, with a replicated ``A`` shared by the HF modules."""
    from dapo_megatron.policy.lora.mapping import adapter_mapping
    from dapo_megatron.policy.weight_mapping import ShardGeometry, full_model_mappings, hf_from_shards

    spec = model_spec_from_hf(published_hf_config("Qwen2.5-0.5B", hidden_size=32, intermediate_size=48,
                                                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                                                  vocab_size=64))
    geometry = ShardGeometry(spec, 2, lora_rank=3)
    generator = torch.Generator().manual_seed(0)
    for mapping in full_model_mappings(spec):
        if not mapping.megatron_name.endswith(("linear_qkv.weight", "linear_fc1.weight")):
            continue
        b_mapping, a_mapping = adapter_mapping(mapping, "B"), adapter_mapping(mapping, "A")
        rows = {"linear_qkv.weight": (spec.num_attention_heads + 2 * spec.num_kv_heads) * spec.head_dim,
                "linear_fc1.weight": 2 * spec.ffn_hidden_size}[mapping.megatron_name.split(".", 4)[-1]]
        w_shards = [torch.randn(rows // 2, spec.hidden_size, generator=generator) for _ in range(2)]
        b_shards = [torch.randn(rows // 2, 3, generator=generator) for _ in range(2)]
        a = torch.randn(3, spec.hidden_size, generator=generator)
        merged = hf_from_shards(mapping, geometry, [w + b @ a for w, b in zip(w_shards, b_shards)])
        base = hf_from_shards(mapping, geometry, w_shards)
        b_hf = hf_from_shards(b_mapping, geometry, b_shards)
        a_hf = hf_from_shards(a_mapping, geometry, [a, a])
        assert len(a_hf) == len(b_hf) == len(mapping.hf_names) and all("lora_A" in n for n in a_mapping.hf_names)
        for got, w, b, a_i in zip(merged, base, b_hf, a_hf):
            torch.testing.assert_close(got, w + b @ a_i)
        # the control: exporting B with the weights' naive concatenation (shard 0's rows, then shard 1's) is wrong
        naive = torch.cat(b_shards)[: b_hf[0].shape[0]]
        assert not torch.allclose(naive, b_hf[0])


def test_adapter_sizes_are_peft_counts_for_qwen25_7b():
    """Rank 16 on every linear of Qwen2.5-7B: 40,370,176 parameters in PEFT's form (what PEFT prints for its
    all-linear adapter), fewer in megatron's, where a fused linear's HF modules share A; both under 1 %."""
    spec = model_spec_from_hf(published_hf_config("Qwen2.5-7B"))
    sizes = adapter_sizes(spec, rank=16, target_modules=LoRAConfig().target_modules)
    assert sizes.handoff == 40_370_176
    per_layer_shared_a = 16 * 3584 * 2 + 16 * 3584  # q/k/v share one A (two fewer), gate/up one (one fewer)
    assert sizes.trainable == sizes.handoff - 28 * per_layer_shared_a
    assert 7.6e9 < sizes.model < 7.7e9 and sizes.handoff_fraction < 0.01
    only_qkv = adapter_sizes(spec, rank=16, target_modules=["linear_qkv"])
    assert only_qkv.trainable == 28 * 16 * (3584 + 3584 + 2 * 512)


def test_the_embedded_engine_merges_an_adapter_and_a_new_one_replaces_it(model_dir):
    from safetensors.torch import load_file

    from dapo_megatron.rollout.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine.from_hf_directory(model_dir)
    base = load_file(str(model_dir / "model.safetensors"))
    q, down = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"
    first = _adapter({q: tuple(base[q].shape), down: tuple(base[down].shape)}, seed=1)
    second = _adapter({q: tuple(base[q].shape)}, seed=2)
    weights = dict(engine.model.named_parameters())
    engine.update_adapter(first, version=1)
    torch.testing.assert_close(weights[q], base[q] + first.delta(q))
    torch.testing.assert_close(weights[down], base[down] + first.delta(down))
    engine.update_adapter(second, version=2)  # replaces the first: down_proj gets its base back
    torch.testing.assert_close(weights[q], base[q] + second.delta(q))
    assert torch.equal(weights[down], base[down]) and engine.weight_version == 2
    misfit = _adapter({q: (3, 3)})
    with pytest.raises(ValueError, match="does not fit the model.*q_proj"):
        engine.update_adapter(misfit, version=3)
    assert engine.weight_version == 2  # nothing was changed
    torch.testing.assert_close(weights[q], base[q] + second.delta(q))
    engine.shutdown()


class RecordingClient:
    """Stands for a server in the books' test: records the loads and unloads it receives."""

    base_url = "http://recording"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def load_lora_adapter_from_tensors(self, name, config, payload) -> None:
        assert config["r"] == 2 and len(payload) == 1
        self.calls.append(f"load {name}")

    def unload_lora_adapter(self, name) -> None:
        self.calls.append(f"unload {name}")


def test_an_old_adapter_is_unloaded_when_its_last_request_is_back():
    from dapo_megatron.rollout.sglang.lora_adapters import ServedAdapters

    client = RecordingClient()
    books = ServedAdapters(lambda: [(client, 1)])
    adapter = _adapter({"model.layers.0.mlp.down_proj.weight": (4, 4)})
    with books.request() as (fields, version):
        assert (fields, version) == ({}, None)  # before any adapter: the base
    books.push(adapter, 1)
    inside, release = threading.Event(), threading.Event()

    def long_request():
        with books.request() as (fields, version):
            assert (fields, version) == ({"lora_path": "policy_v1"}, 1)
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=long_request)
    thread.start()
    inside.wait(30)
    books.push(adapter, 2)  # v1 still has a request in flight: not unloaded
    assert client.calls == ["load policy_v1", "load policy_v2"] and books.held_versions() == [1, 2]
    with books.request() as (fields, _):
        assert fields == {"lora_path": "policy_v2"}
    release.set()
    thread.join(30)
    assert client.calls[-1] == "unload policy_v1" and books.held_versions() == [2]
    books.push(adapter, 3)  # nothing in flight on v2: unloaded at once
    assert client.calls[-2:] == ["load policy_v3", "unload policy_v2"]
    restarted = RecordingClient()
    books.reload(restarted, 1)
    assert restarted.calls == ["load policy_v3"]
    with pytest.raises(Exception, match="not newer"):
        books.push(adapter, 3)


def test_servers_for_adapters_start_with_the_rank_and_the_hf_modules():
    from dapo_megatron.rollout.sglang.lora_adapters import lora_server_arguments

    lora = LoRAConfig(enabled=True, rank=8, target_modules=["linear_qkv", "linear_fc2"])
    assert lora_server_arguments(lora, "cuda") == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules",
                                                   "q_proj", "k_proj", "v_proj", "down_proj",
                                                   "--max-loras-per-batch", "2"]
    assert lora_server_arguments(lora, "cpu")[-2:] == ["--lora-backend", "torch_native"]
    # colocated on GPUs the released weights must come back with the base in them (the handoff sends no base)
    assert lora_server_arguments(lora, "cuda", colocated=True)[-1] == "--enable-weights-cpu-backup"
    assert "--enable-weights-cpu-backup" not in lora_server_arguments(lora, "cpu", colocated=True)


COLOCATED = ["rollout.engine=sglang", "rollout.placement=colocated", "rollout.sglang.mem_fraction_static=0.5"]


def test_the_frozen_base_leaves_the_device_and_comes_back_whole():
    """FrozenWeights (trainer/colocation.py) on CPU tensors: the storage of the parameters that do not train is
    freed and restored bit for bit; the trained ones are never touched. Colocation uses it only colocated on GPUs."""
    from dapo_megatron.config import load_config
    from dapo_megatron.trainer.colocation import Colocation, FrozenWeights

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    frozen = FrozenWeights(model)
    frozen.release()
    assert model[0].weight.numel() == 0 and model[0].bias.numel() == 0 and model[1].weight.shape == (2, 3)
    frozen.release()  # twice: nothing more happens
    frozen.restore()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    config = load_config("examples/tiny_cpu_lora.yaml", COLOCATED)
    assert not Colocation(config, None, lambda: None, device_type="cpu", model=model).offload_frozen_weights
    assert Colocation(config, None, lambda: None, device_type="cuda", model=model).offload_frozen_weights
    plain = load_config("examples/tiny_cpu.yaml", COLOCATED)
    assert not Colocation(plain, None, lambda: None, device_type="cuda", model=model).offload_frozen_weights


def test_a_handoff_that_sends_the_base_finds_it_on_the_device():
    """Colocated servers attached by URL get the base in the first handoff, read from the trainer's copy: released
    before, the export would read parameters without elements. Later handoffs (the adapter alone) release it."""
    from dapo_megatron.config import load_config
    from dapo_megatron.trainer.colocation import Colocation

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)
    config = load_config("examples/tiny_cpu_lora.yaml", COLOCATED + ["rollout.sglang.urls=[http://10.0.0.1:30000]"])
    colocation = Colocation(config, None, lambda: None, device_type="cuda", model=model)  # as on a GPU; CPU tensors
    colocation.before_handoff(base_served=False)
    assert model[0].weight.numel() == 12  # the first handoff exports it
    colocation.before_handoff(base_served=True)
    assert model[0].weight.numel() == 0  # the control: once served, the base leaves the device


class _TELinearLike(torch.nn.Module):
    """What the adapter reads of a Transformer Engine linear (TE is not installed here): its parallel mode, and a
    grouped-GEMM expert module's ``num_gemms``."""

    def __init__(self, parallel_mode, num_gemms=None):
        super().__init__()
        self.parallel_mode = parallel_mode
        if num_gemms is not None:
            self.num_gemms = num_gemms


def test_which_linears_take_an_adapter():
    from dapo_megatron.policy.lora.adapter import LoRALayoutError, parallel_mode

    assert parallel_mode(_TELinearLike("column")) == "column"
    assert parallel_mode(_TELinearLike("row")) == "row"
    assert parallel_mode(_TELinearLike(None)) is None  # not a linear an adapter goes on
    assert parallel_mode(torch.nn.LayerNorm(4)) is None
    with pytest.raises(LoRALayoutError, match="duplicated"):
        parallel_mode(_TELinearLike("duplicated"))
    # grouped-GEMM experts are refused at every layout: at TP or EP > 1 megatron gives them parallel_mode None
    for mode in ("column", None):
        with pytest.raises(LoRALayoutError, match="grouped-GEMM experts"):
            parallel_mode(_TELinearLike(mode, num_gemms=4))


class _TEFusedNormLinearLike(_TELinearLike):
    """Transformer Engine's fused RMSNorm + column-parallel linear as the adapter sees it: ``layer_norm_weight``, a
    weight, no TP group, and ``(output, bias)`` from forward (the norm left out: the adapter's side is measured)."""

    def __init__(self, hidden: int, out: int):
        super().__init__("column")
        self.tp_group = None
        self.weight = torch.nn.Parameter(torch.randn(out, hidden, dtype=torch.bfloat16), requires_grad=False)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x):
        return x @ self.weight.T, None


def test_the_planned_activations_of_a_fused_norm_adapter_are_what_autograd_keeps():
    """What backward keeps of one adapter on a fused norm + linear (bf16), per token, against ``plan``'s count: the
    ``[t, r]`` product, the normalized input, and ONE float32 copy of the input (two copies, one per use, was the
    bug this guards: 2 more bytes a value)."""
    from dapo_megatron.policy.lora.adapter import AdapterPlacement, LoRAAdapter
    from dapo_megatron.policy.memory.lora import adapter_activation_values_per_token

    hidden, out, rank, tokens = 64, 96, 4, 32
    linear = _TEFusedNormLinearLike(hidden, out)
    placement = AdapterPlacement(mode="column", in_features=hidden, out_features=out, tensor_parallel=1, tp_rank=0,
                                 sequence_parallel=False, expert=False, gated=False, norm_eps=1e-6)
    adapter = LoRAAdapter(linear, placement, LoRAConfig(enabled=True, rank=rank), seed=0,
                          key="0/self_attention.linear_qkv")
    parameters = {p.data_ptr() for p in (*linear.parameters(), *adapter.parameters())}
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(tensor):
        if tensor.data_ptr() not in parameters and tensor.data_ptr() != x.data_ptr():  # the base keeps x anyway
            kept[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output, _ = linear(x)  # the adapter's forward hook adds its part
    assert output.requires_grad
    # linear_qkv of this shape: hidden -> q + 2k = 64 + 2 * 16 = out
    spec = model_spec_from_hf(published_hf_config("Qwen2.5-0.5B", hidden_size=hidden, num_attention_heads=4,
                                                  num_key_value_heads=1, intermediate_size=8, num_hidden_layers=1,
                                                  vocab_size=64))
    assert spec.hidden_size == hidden and (spec.num_attention_heads + 2 * spec.num_kv_heads) * spec.head_dim == out
    planned = adapter_activation_values_per_token(spec, LoRAConfig(enabled=True, rank=rank,
                                                                   target_modules=["linear_qkv"]),
                                                  tensor_parallel=1, sequence_parallel=False,
                                                  transformer_engine=True, precision="bf16") * 2  # bytes
    measured = sum(kept.values()) / tokens
    assert planned == (rank + 3 * hidden) * 2
    assert measured == pytest.approx(planned, rel=0.02)  # one float32 per token more: the norm's rsqrt


def test_the_planned_adapter_activations_by_hand_with_sequence_parallelism_and_full_recomputation():
    from dapo_megatron.policy.memory.gpu import estimate_memory
    from dapo_megatron.policy.memory.lora import adapter_activation_values_per_token, with_lora

    spec = model_spec_from_hf(published_hf_config("Qwen2.5-7B"))
    lora, h, r, tp = LoRAConfig(enabled=True, rank=16), 3584, 16, 4
    for sequence_parallel, share in ((False, 1), (True, 1 / tp)):
        values = adapter_activation_values_per_token(spec, lora, tensor_parallel=tp, transformer_engine=True,
                                                     sequence_parallel=sequence_parallel, precision="bf16")
        # A x of the 4 linears; the normalized input and its float32 copy (2 bf16 values) at linear_qkv and linear_fc1
        assert values == pytest.approx(4 * r + 2 * h * share * 3)
    layout = dict(tensor_parallel=tp, data_parallel=1, precision="bf16", micro_batch_tokens=4096)
    planned = {}
    for recompute in ("selective", "full"):
        stages = estimate_memory(spec, pipeline_parallel=2, distributed_optimizer=True, recompute=recompute, **layout)
        with_adapters = with_lora(stages, spec, lora, expert_parallel=1, distributed_optimizer=True,
                                  transformer_engine=True, recompute=recompute, sequence_parallel=True, **layout)
        planned[recompute] = [lora_stage.activations_bytes - stage.activations_bytes
                              for stage, lora_stage in zip(stages, with_adapters)]
    per_layer = (4 * r + 2 * h / tp * 3) * 4096 * 2
    # 1F1B: the first of 2 stages keeps 2 micro-batches' activations of its 14 layers, the last 1; under full
    # recomputation a layer keeps its input only, and the adapters' activations are one layer's, recomputed
    assert planned["selective"] == [int(2 * 14 * per_layer), int(14 * per_layer)]
    assert planned["full"] == [int(per_layer)] * 2
