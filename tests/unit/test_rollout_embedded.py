"""The embedded rollout engine against HF transformers on tiny random Qwen2 / Llama / Qwen3 / Qwen3-MoE models (CPU,
seconds)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import hf_greedy
from tiny_qwen3 import tiny_qwen3_config, tiny_qwen3_moe_config
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from dapo_megatron.backend_registry import select_backend
from dapo_megatron.config import ConfigError, EmbeddedConfig, load_config
from dapo_megatron.rollout import RolloutError, SamplingParams
from dapo_megatron.rollout.embedded.decode_batch import LeftPaddedBatch, preallocated_kv_cache, prefill
from dapo_megatron.rollout.embedded.engine import NO_WEIGHTS_VERSION, EmbeddedEngine
from dapo_megatron.rollout.factory import build_rollout_engine
from dapo_megatron.rollout.embedded.lean_decode import LeanDecoder, ModelDecodeStep
from dapo_megatron.rollout.embedded.named_tensors import checkpoint_targets

VOCAB = 101


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def qwen2_config(tie: bool = True) -> Qwen2Config:
    """Qwen2 (QKV bias) with GQA: 6 query heads over 2 KV heads."""
    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def reference_model(config, seed: int = 0) -> torch.nn.Module:
    """The HF model the engine is compared with. A large init (std 0.15) makes distributions far from uniform (no
    greedy near-ties, diverse samples and stops); norms and biases are perturbed so none is a trivial 1 or 0."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2:
                param.normal_(0.0, 0.15)
            else:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def qwen3_config() -> object:
    """Qwen3: q/k norms, head_dim 12 (hidden 48 / 6 heads would be 8), vocab as the other configs."""
    config = tiny_qwen3_config(vocab_size=VOCAB, num_layers=2)
    config.max_position_embeddings = 128
    return config


def qwen3_moe_config() -> object:
    """Qwen3-MoE: 5 experts, top-3, renormalized."""
    config = tiny_qwen3_moe_config(vocab_size=VOCAB, num_layers=2)
    config.max_position_embeddings = 128
    return config


def checkpoint_tensors(model, directory) -> list[tuple[str, torch.Tensor]]:
    """The tensors of ``model`` as its checkpoint names them: transformers' own ``save_pretrained`` (which splits
    fused experts back into per-expert tensors), read back."""
    model.save_pretrained(directory, safe_serialization=True)
    return list(load_file(str(directory / "model.safetensors")).items())


def loaded_engine(config, model, version: int = 0, **kwargs) -> EmbeddedEngine:
    engine = EmbeddedEngine(config, **kwargs)
    engine.update_weights([list(model.state_dict().items())], version)
    return engine


PROMPTS = [[5, 17, 33, 2, 9, 41, 60], [7, 7, 12], [88, 3, 54, 21, 30]]  # different lengths: left padding matters


def recomputed_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """Full-sequence forward of prompt + response alone (no cache, no padding), log_softmax(logits / T)."""
    tokens = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------------
# generate


def test_n_samples_per_prompt_with_stop_and_length_endings():
    config = qwen2_config()
    engine = loaded_engine(config, reference_model(config), version=3)
    stop_ids = tuple(range(10, 20))
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, stop_token_ids=stop_ids, seed=11)
    groups = engine.generate(PROMPTS, params)

    assert len(groups) == len(PROMPTS)
    reasons = set()
    for prompt_index, group in enumerate(groups):
        assert len(group) == 4
        for sample in group:
            assert sample.prompt_index == prompt_index
            assert sample.weight_version == 3
            assert len(sample.token_ids) == len(sample.logprobs) >= 1
            assert all(0 <= token < VOCAB for token in sample.token_ids)
            assert all(logprob <= 0.0 for logprob in sample.logprobs)
            assert not any(token in stop_ids for token in sample.token_ids[:-1])
            if sample.finish_reason == "stop":
                assert sample.token_ids[-1] in stop_ids  # the stop token is kept
            else:
                assert sample.finish_reason == "length"
                assert len(sample.token_ids) == 8 and sample.token_ids[-1] not in stop_ids
            reasons.add(sample.finish_reason)
    assert reasons == {"stop", "length"}


def test_same_seed_same_samples_other_seed_differs_and_global_rng_untouched():
    config = qwen2_config()
    engine = loaded_engine(config, reference_model(config))
    params = SamplingParams(n=4, max_new_tokens=10, seed=5)
    rng_before = torch.get_rng_state()
    first = engine.generate(PROMPTS, params)
    second = engine.generate(PROMPTS, params)
    other = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=10, seed=6))
    assert torch.equal(rng_before, torch.get_rng_state()), "generation consumed the global torch RNG"

    tokens = lambda groups: [[sample.token_ids for sample in group] for group in groups]  # noqa: E731
    assert tokens(first) == tokens(second)
    assert [[s.logprobs for s in g] for g in first] == [[s.logprobs for s in g] for g in second]
    assert tokens(first) != tokens(other)
    # The n copies of a prompt are distinct samples, not one sample repeated.
    assert len({tuple(ids) for ids in tokens(first)[0]}) > 1
    # seed=None draws a fresh seed per call.
    unseeded = SamplingParams(n=4, max_new_tokens=10, seed=None)
    assert tokens(engine.generate(PROMPTS, unseeded)) != tokens(engine.generate(PROMPTS, unseeded))


def test_samples_do_not_depend_on_chunking_or_dropping_finished_rows():
    config = qwen2_config()
    model = reference_model(config)
    params = SamplingParams(n=4, max_new_tokens=12, stop_token_ids=tuple(range(10, 20)), seed=21)
    whole = loaded_engine(config, model, settings=EmbeddedConfig(max_batch_rows=512, drop_finished_fraction=2.0)
                          ).generate(PROMPTS, params)
    chunked = loaded_engine(config, model, settings=EmbeddedConfig(max_batch_rows=3, drop_finished_fraction=0.0)
                            ).generate(PROMPTS, params)
    for group_whole, group_chunked in zip(whole, chunked):
        for a, b in zip(group_whole, group_chunked):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@pytest.mark.parametrize("make_config", [qwen2_config, llama_config, qwen3_config, qwen3_moe_config],
                         ids=["qwen2", "llama", "qwen3", "qwen3_moe"])
def test_greedy_equals_hf_generate(make_config, tmp_path):
    config = make_config()
    model = reference_model(config)
    engine = EmbeddedEngine(config)
    engine.update_weights([checkpoint_tensors(model, tmp_path)], 0)
    groups = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=12))
    for prompt, group in zip(PROMPTS, groups):
        expected = hf_greedy(model, prompt, 12)
        assert [sample.token_ids for sample in group] == [expected, expected]


def test_padded_batch_equals_prompt_alone():
    config = qwen2_config()
    engine = loaded_engine(config, reference_model(config))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=10)
    short = PROMPTS[1]
    alone = engine.generate([short], params)[0][0]
    padded = engine.generate([PROMPTS[0], short], params)[1][0]  # 4 pad slots in front of `short`
    assert alone.token_ids == padded.token_ids
    max_diff = max(abs(a - b) for a, b in zip(alone.logprobs, padded.logprobs))
    print(f"padded vs alone max |logprob diff| = {max_diff:.2e}")
    assert max_diff < 1e-5


@pytest.mark.parametrize("temperature", [0.7, 1.0, 0.0])
def test_logprobs_equal_full_forward_recompute(temperature):
    config = qwen2_config()
    model = reference_model(config)
    engine = loaded_engine(config, model)
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=10, seed=2)
    max_diff = 0.0
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, params)):
        for sample in group:
            # Greedy reports the untempered distribution (temperature 1).
            expected = recomputed_logprobs(model, prompt, sample.token_ids, temperature or 1.0)
            max_diff = max(max_diff, (torch.tensor(sample.logprobs) - expected).abs().max().item())
    print(f"T={temperature}: engine vs full-forward max |logprob diff| = {max_diff:.2e}")
    assert max_diff < 1e-5


def test_prefill_runs_each_distinct_prompt_once():
    """The n rows of a prompt share one prefill. A prompt starting with token 0 (the pad id) and the same prompt
    without it are padded to the same ids; they must stay two prefixes (else one would read the other's cache)."""
    config = qwen2_config()
    model = reference_model(config)
    engine = loaded_engine(config, model)
    prompts = [[0, 7, 12], [7, 12], [88, 3, 54]]
    prefill_rows = []
    hook = engine.model.model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: prefill_rows.append(inputs[0].shape[0]))
    groups = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=3))
    hook.remove()
    assert prefill_rows == [3]  # 12 rows, 3 distinct prompts (the decode steps do not call the embedding module)
    max_diff = max((torch.tensor(sample.logprobs) - recomputed_logprobs(model, prompt, sample.token_ids, 1.0))
                   .abs().max().item() for prompt, group in zip(prompts, groups) for sample in group)
    assert max_diff < 1e-5


def test_top_k_1_and_tiny_top_p_equal_greedy_with_untruncated_logprobs():
    config = qwen2_config()
    model = reference_model(config)
    engine = loaded_engine(config, model)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10))
    top_k_1 = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.5, top_k=1, max_new_tokens=10, seed=1))
    top_p_tiny = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, top_p=1e-6, max_new_tokens=10, seed=1))
    for prompt, g, k, p in zip(PROMPTS, greedy, top_k_1, top_p_tiny):
        assert [s.token_ids for s in k] == [g[0].token_ids] * 2
        assert [s.token_ids for s in p] == [g[0].token_ids] * 2
        # Log-probs are taken before truncation (a truncated, renormalised distribution would give exactly 0).
        expected = recomputed_logprobs(model, prompt, g[0].token_ids, 0.5)
        assert (torch.tensor(k[0].logprobs) - expected).abs().max().item() < 1e-5
        assert max(k[0].logprobs) < 0.0


def test_top_k_and_top_p_restrict_the_sampled_tokens():
    config = qwen2_config()
    model = reference_model(config)
    engine = loaded_engine(config, model)
    prompt = PROMPTS[0]
    with torch.no_grad():
        first_logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    probs = torch.softmax(first_logits, dim=-1)
    top3 = set(first_logits.topk(3).indices.tolist())
    sorted_probs, order = probs.sort(descending=True)
    nucleus_size = int((sorted_probs.cumsum(0) - sorted_probs < 0.6).sum())
    nucleus = set(order[:nucleus_size].tolist())

    first_tokens = lambda params: {s.token_ids[0] for s in engine.generate([prompt], params)[0]}  # noqa: E731
    assert first_tokens(SamplingParams(n=64, top_k=3, max_new_tokens=1, seed=0)) <= top3
    assert first_tokens(SamplingParams(n=64, top_p=0.6, max_new_tokens=1, seed=0)) <= nucleus
    unrestricted = first_tokens(SamplingParams(n=64, max_new_tokens=1, seed=0))
    assert not unrestricted <= top3, "the test cannot tell truncation apart from no truncation"


# ---------------------------------------------------------------------------------------------------------------
# update_weights


def test_update_weights_names_missing_unexpected_wrong_shape_and_duplicate_tensors():
    config = qwen2_config()
    state = reference_model(config).state_dict()
    engine = loaded_engine(config, reference_model(config))
    assert engine.weight_version == 0

    named = [(name, tensor) for name, tensor in state.items() if name != "lm_head.weight"]
    missing = [(n, t) for n, t in named if n != "model.layers.1.mlp.up_proj.weight"]
    extra = named + [("model.layers.7.self_attn.q_proj.weight", torch.zeros(48, 48))]
    wrong_shape = [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in named]
    duplicate = named + [("model.layers.0.input_layernorm.weight", state["model.layers.0.input_layernorm.weight"])]
    not_finite = [(n, torch.full_like(t, float("nan")) if n == "model.norm.weight" else t) for n, t in named]
    cases = {  # each the one problem reported, on a line of its own
        "  missing tensors: model.layers.1.mlp.up_proj.weight": missing,
        "  unexpected tensors: model.layers.7.self_attn.q_proj.weight (48, 48)": extra,
        "  shape mismatches: model.norm.weight: shape [47], expected [48]": wrong_shape,
        "  provided more than once: model.layers.0.input_layernorm.weight": duplicate,
        "  bad values: model.norm.weight: contains NaN or inf": not_finite,
    }
    for expected_line, tensors in cases.items():
        with pytest.raises(ValueError) as error:
            engine.update_weights([tensors[:5], tensors[5:]], version=1)
        assert str(error.value).splitlines()[1:] == [expected_line]
        assert "version=1" in str(error.value)
        # A failed update leaves nothing served.
        assert engine.weight_version == NO_WEIGHTS_VERSION and not engine.health().healthy
        with pytest.raises(RolloutError, match="no weights loaded"):
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))

    with pytest.raises(ValueError, match="tied weights disagree"):
        engine.update_weights([named + [("lm_head.weight", torch.zeros_like(state["lm_head.weight"]))]], version=1)
    engine.update_weights([named], version=1)  # tied: lm_head.weight may be absent
    assert engine.weight_version == 1
    with pytest.raises(ValueError, match="older than the served version 1"):
        engine.update_weights([named], version=0)


def test_untied_model_requires_lm_head():
    config = llama_config()
    state = reference_model(config).state_dict()
    engine = EmbeddedEngine(config)
    with pytest.raises(ValueError, match=r"\n  missing tensors: lm_head.weight$"):
        engine.update_weights([[(n, t) for n, t in state.items() if n != "lm_head.weight"]], version=0)


def test_update_with_perturbed_weights_serves_them():
    config = qwen2_config()
    model = reference_model(config)
    engine = loaded_engine(config, model, version=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    before = [group[0].token_ids for group in engine.generate(PROMPTS, params)]

    # bf16 on the wire, as an exporter may send it: the engine casts to its fp32 parameters. The reference gets
    # the same rounding on its parameters only (`model.to(bf16)` would also round the RoPE inv_freq buffer).
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std())
            param.copy_(param.to(torch.bfloat16))
    engine.update_weights(([(n, t.to(torch.bfloat16))] for n, t in model.state_dict().items()), version=5)

    after = engine.generate(PROMPTS, params)
    assert engine.weight_version == 5 and engine.health().weight_version == 5
    assert all(group[0].weight_version == 5 for group in after)
    assert [group[0].token_ids for group in after] == [hf_greedy(model, prompt, 10) for prompt in PROMPTS]
    assert [group[0].token_ids for group in after] != before


def test_each_bucket_is_loaded_before_the_next_is_pulled():
    config = qwen2_config()
    model = reference_model(config)

    def reusing_producer():
        """Like an exporter reusing one buffer: pulling a bucket overwrites the previous bucket's tensors."""
        previous = None
        for name, tensor in model.state_dict().items():
            if previous is not None:
                previous[0][1].fill_(float("nan"))
            previous = [(name, tensor.clone())]
            yield previous

    engine = EmbeddedEngine(config)
    engine.update_weights(reusing_producer(), version=0)
    group = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=8))[0]
    assert group[0].token_ids == hf_greedy(model, PROMPTS[0], 8)
    with pytest.raises(ValueError, match="contains NaN"):  # control: tensors taken after the next pull are clobbered
        engine.update_weights([bucket for bucket in list(reusing_producer())], version=1)


def test_from_hf_directory(tmp_path):
    config = qwen2_config()
    model = reference_model(config)
    model.save_pretrained(tmp_path)
    engine = EmbeddedEngine.from_hf_directory(tmp_path, version=2)
    assert engine.weight_version == 2
    group = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=8))[0]
    assert group[0].token_ids == hf_greedy(model, PROMPTS[0], 8)


EMBEDDED_RUN = ["model.source=tiny", "data.source=synthetic", "rollout.engine=embedded"]


def test_the_run_configs_embedded_section_reaches_the_engine(tmp_path):
    """rollout.embedded.max_batch_rows from the run config, through the engine factory, decides the chunks: 12 rows
    (3 prompts x 4 samples) in chunks of 3 take 4 prefills, with the default 512 rows one (the control)."""
    config = qwen2_config()
    config.save_pretrained(tmp_path)
    model = reference_model(config)
    prefills = {}
    for overrides in ([], ["rollout.embedded.max_batch_rows=3"]):
        engine = build_rollout_engine(load_config(None, EMBEDDED_RUN + overrides), tmp_path, tmp_path / "run",
                                      select_backend())
        engine.update_weights([list(model.state_dict().items())], 0)
        calls = []
        hook = engine.model.model.embed_tokens.register_forward_hook(lambda *_: calls.append(1))
        engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=3, seed=1))
        hook.remove()
        prefills[len(overrides)] = len(calls)
        engine.shutdown()
    assert prefills == {0: 1, 1: 4}


@pytest.mark.parametrize("key,value", [("max_batch_rows", 0), ("max_kv_cache_mb", 0), ("drop_finished_fraction", -1)])
def test_bad_embedded_settings_are_config_errors_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"rollout.embedded.{key}: must be"):
        load_config(None, [*EMBEDDED_RUN, f"rollout.embedded.{key}={value}"])


# ---------------------------------------------------------------------------------------------------------------
# lifecycle and input checks


def test_lifecycle_and_bad_inputs():
    config = qwen2_config()
    engine = EmbeddedEngine(config)
    assert engine.weight_version == NO_WEIGHTS_VERSION
    assert engine.health().detail == "no weights loaded"
    with pytest.raises(RolloutError, match="no weights loaded"):
        engine.generate(PROMPTS, SamplingParams())
    engine.update_weights([list(reference_model(config).state_dict().items())], version=0)
    assert engine.health().healthy

    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside \[0, 101\): \[101\]"):
        engine.generate([[1, 101]], SamplingParams())
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=127))
    with pytest.raises(ValueError, match="stop_token_ids outside"):
        engine.generate([[1, 2]], SamplingParams(stop_token_ids=(500,)))
    with pytest.raises(ValueError, match="supports model types"):
        EmbeddedEngine(type(config).from_dict({**config.to_dict(), "model_type": "gpt2"}))

    with engine:
        pass
    assert not engine.health().healthy and engine.health().detail == "shut down"
    engine.shutdown()  # twice is fine
    with pytest.raises(RolloutError, match="shut down"):
        engine.generate(PROMPTS, SamplingParams())


# ---------------------------------------------------------------------------------------------------------------
# the decode step without transformers' per-call machinery


def llama3_scaled_tied_config() -> LlamaConfig:
    config = llama_config()
    config.num_key_value_heads = 2
    config.tie_word_embeddings = True
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return config


@pytest.mark.parametrize("make", [qwen2_config, lambda: qwen2_config(tie=False), llama_config,
                                  llama3_scaled_tied_config, qwen3_config])
def test_lean_decode_step_equals_the_model(make):
    config = make()
    model = reference_model(config)
    steps = 6
    batch = LeftPaddedBatch.build(PROMPTS, steps, pad_token_id=0)
    padded = batch.padded_length

    def decode(step_fn) -> list[torch.Tensor]:
        cache = preallocated_kv_cache(config.num_hidden_layers, padded + steps)
        with torch.inference_mode():
            cache, logits = prefill(model, batch.input_ids, batch.key_valid, cache)
            out = []
            for step in range(steps):
                tokens = logits.argmax(-1)
                logits = step_fn(tokens, batch.key_valid[:, None, None, : padded + step + 1],
                                 (batch.prompt_lengths + step)[:, None], cache)
                out.append(logits)
        return out

    def through_model(tokens, mask, positions, cache):
        return model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, cache=cache,
                     use_cache=True).logits[:, -1]

    reference = decode(through_model)
    lean = decode(LeanDecoder(model))
    max_diff = max((a - b).abs().max().item() for a, b in zip(lean, reference))
    print(f"lean decode step vs the model: max |logit diff| = {max_diff:.2e}")
    assert max_diff < 1e-5
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(lean, reference))
    # control: the comparison is not vacuous (one step later, other positions, other logits)
    assert (reference[0] - reference[1]).abs().max() > 1e-2


def test_moe_models_decode_through_the_model_and_load_per_expert_checkpoint_tensors(tmp_path):
    """transformers 5 keeps a MoE layer's experts fused ([E, 2I, H] gate/up, [E, H, I] down); the handoff sends the
    checkpoint's per-expert tensors. Every checkpoint name maps to exactly the elements save_pretrained wrote there."""
    config = qwen3_moe_config()
    model = reference_model(config)
    saved = dict(checkpoint_tensors(model, tmp_path))
    targets = checkpoint_targets(model)
    assert set(targets) == set(saved) and "model.layers.1.mlp.experts.4.up_proj.weight" in targets
    assert all(torch.equal(targets[name], tensor) for name, tensor in saved.items())
    engine = EmbeddedEngine(config)
    assert isinstance(engine.decode_step, ModelDecodeStep)
    expert = "model.layers.0.mlp.experts.2."
    with pytest.raises(ValueError, match=expert + "down_proj.weight"):  # one expert's tensor missing
        engine.update_weights([[(n, t) for n, t in saved.items() if n != expert + "down_proj.weight"]], 0)
    swapped = {**saved, expert + "gate_proj.weight": saved[expert + "up_proj.weight"]}
    engine.update_weights([list(swapped.items())], 1)  # control: gate and up of one expert exchanged
    assert not torch.equal(engine.model.model.layers[0].mlp.experts.gate_up_proj,
                           model.model.layers[0].mlp.experts.gate_up_proj)
    engine.update_weights([list(saved.items())], 2)
    assert torch.equal(engine.model.model.layers[0].mlp.experts.gate_up_proj,
                       model.model.layers[0].mlp.experts.gate_up_proj)
