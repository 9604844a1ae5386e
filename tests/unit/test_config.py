"""The config schema: paper defaults, YAML + dotted overrides, errors that name the key, the examples load."""

import dataclasses
import math
import re
from pathlib import Path

import pytest

from dapo_megatron.config import (
    AlgorithmConfig,
    ConfigError,
    DAPOConfig,
    DataConfig,
    EvalConfig,
    FormatRewardConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    SGLangConfig,
    TrainerConfig,
    WarmStartConfig,
    config_to_dict,
    load_config,
    save_config,
)

REPO = Path(__file__).resolve().parents[2]
MINIMAL = ["model.hf_path=/models/x", "data.train_files=[a.parquet]"]


def test_defaults_are_the_papers_recipe():
    c = DAPOConfig()
    a, r, t, o = c.algorithm, c.rollout, c.trainer, c.optim
    assert (a.eps_low, a.eps_high, a.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert a.aggregation == "token-mean" and a.dynamic_sampling and a.overlong_penalty
    assert (a.overlong_buffer_len, a.overlong_penalty_factor) == (4096, 1.0)
    assert (a.gen_batch_size, a.max_gen_rounds) == (1536, 10)
    assert (r.n_samples, r.temperature, r.top_p, r.max_response_length) == (16, 1.0, 1.0, 20480)
    assert (t.train_batch_size, t.mini_batch_size) == (512, 32)
    assert (o.lr, o.warmup_steps, o.weight_decay, o.grad_clip) == (1e-6, 10, 0.1, 1.0)
    assert (c.eval.n_samples, c.eval.top_p) == (32, 0.7)


def test_overrides_are_typed_and_win_over_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout: {n_samples: 8}\nalgorithm: {eps_high: 0.3}\n")
    c = load_config(path, MINIMAL + ["rollout.n_samples=4", "algorithm.clip_ratio_c=null",
                                     "rollout.sglang.urls=[\"http://h:1\", \"http://h:2\"]"])
    assert c.rollout.n_samples == 4 and c.algorithm.eps_high == 0.3 and c.algorithm.clip_ratio_c is None
    assert c.rollout.sglang.urls == ["http://h:1", "http://h:2"]


@pytest.mark.parametrize("override, message", [
    ("rollout.nsamples=3", "unknown key rollout.nsamples"),
    ("bogus.key=1", "unknown key bogus"),
    ("rollout.n_samples=abc", "rollout.n_samples: expected an integer"),
    ("rollout.n_samples=true", "rollout.n_samples: expected an integer"),
    ("algorithm.loss_agg=seq-mean", "algorithm.loss_agg: must be one of"),
    ("trainer.mini_batch_size=5", "trainer.mini_batch_size: must divide"),
    ("algorithm.eps_low=1.5", "algorithm.eps_low"),
    ("algorithm.overlong_buffer_len=999999", "algorithm.overlong_buffer_len"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("rollout.sglang=3", "rollout.sglang: expected a mapping"),
    ("rollout.n_samples='4'", "rollout.n_samples: expected an integer"),
    ("rollout.temperature=true", "rollout.temperature: expected a number"),
    ("rollout.sglang.transport=rdma", "rollout.sglang.transport: must be one of"),
    ("rollout.sglang.num_servers=0", "rollout.sglang.num_servers: must be >= 1"),
    ("rollout.sglang.tp_per_server=0", "rollout.sglang.tp_per_server: must be >= 1"),
    ("rollout.sglang.launch_timeout_s=0", "rollout.sglang.launch_timeout_s: must be > 0"),
    ("rollout.sglang.request_timeout_s=0", "rollout.sglang.request_timeout_s: must be > 0"),
    ("rollout.sglang.max_restarts=-1", "rollout.sglang.max_restarts: must be >= 0"),
    ("rollout.sglang.max_in_flight_samples=0", "rollout.sglang.max_in_flight_samples: must be >= 1"),
    ("rollout.sglang.reply_processes=-1", "rollout.sglang.reply_processes: must be >= 0"),
    ("optim.warmup_steps=-1", "optim.warmup_steps: must be >= 0"),
    ("optim.grad_clip=-1", "optim.grad_clip: must be >= 0"),
    ("trainer.micro_batch_tokens=0", "trainer.micro_batch_tokens: must be >= 1"),
    ("parallel.expert=0", "parallel.expert: must be >= 1"),
    ("algorithm.moe_routing_replay=always", "algorithm.moe_routing_replay: must be one of"),
    ("model.moe.aux_loss_coeff=-0.1", "model.moe.aux_loss_coeff: must be >= 0"),
    ("model.tiny.arch=qwen4", "model.tiny.arch: must be one of"),
    ("noequals", "dotted.key=value"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, MINIMAL + [override])


@pytest.mark.parametrize("override, message", [
    ("parallel.expert=2", "parallel.expert: expert parallelism needs a mixture-of-experts model"),
    ("algorithm.moe_routing_replay=replay_old", "algorithm.moe_routing_replay: replay_old needs a mixture"),
])
def test_moe_settings_on_a_dense_tiny_model_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, MINIMAL + ["model.source=tiny", override])
    load_config(None, MINIMAL + ["model.source=tiny", "model.tiny.arch=qwen3_moe", override])  # control


def test_attached_servers_need_no_server_count():
    config = load_config(None, MINIMAL + ["rollout.sglang.num_servers=0", "rollout.sglang.urls=[http://h:1]"])
    assert config.rollout.sglang.num_servers == 0


def test_missing_required_inputs_are_named():
    with pytest.raises(ConfigError, match="model.hf_path"):
        load_config(None, ["data.train_files=[a]"])
    with pytest.raises(ConfigError, match="data.train_files"):
        load_config(None, ["model.hf_path=/m"])


def test_bad_yaml_file_is_named(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("rollout: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("spelling, value", [("1e-6", 1e-6), ("5e-5", 5e-5), ("1E-6", 1e-6), ("2e0", 2.0),
                                             ("1_000.5e-3", 1.0005), (".5", 0.5), ("3", 3.0)])
def test_every_float_spelling_python_accepts_is_a_number_in_a_file_and_on_the_command_line(tmp_path, spelling, value):
    """Issue 33.3: YAML 1.1 (PyYAML) reads `1e-6` as a string; the paper's learning rate was refused."""
    path = tmp_path / "c.yaml"
    path.write_text(f"optim:\n  lr: {spelling}\n")
    assert load_config(path, MINIMAL).optim.lr == value
    assert load_config(None, MINIMAL + [f"optim.lr={spelling}"]).optim.lr == value


@pytest.mark.parametrize("override, message", [
    ("optim.lr=-1e-4", "optim.lr: must be > 0"),  # a number, refused for its value, not as "not a number"
    ("optim.lr=1e-", "optim.lr: expected a number, got '1e-'"),
    ("optim.lr=fast", "optim.lr: expected a number, got 'fast'"),
    ("optim.lr=[1e-6]", "optim.lr: expected a number"),
    ("rollout.n_samples=1e1", "rollout.n_samples: expected an integer"),
])
def test_what_is_not_a_number_is_still_refused(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(None, MINIMAL + [override])


def test_a_config_file_that_is_not_utf8_is_one_line_naming_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("trainer:\n  run_dir: runs/caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"{path}: line 2 is not UTF-8 text \\(byte 0xe9\\)"):
        load_config(path, MINIMAL)


def test_saved_config_reloads_identically(tmp_path):
    c = load_config(REPO / "examples" / "tiny_cpu.yaml", ["trainer.total_steps=3"])
    save_config(c, tmp_path / "config.yaml")
    assert config_to_dict(load_config(tmp_path / "config.yaml")) == config_to_dict(c)  # the objective's own filled


def test_every_example_loads():
    examples = sorted((REPO / "examples").rglob("*.yaml"))
    assert len(examples) >= 9
    for path in examples:
        load_config(path)


def test_base_chain_loop_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "a.yaml")


# One bad value per section of DAPOConfig, each caught by that section's own check: (the section as it must be for a
# run to start, the section with the bad value, the message). Nested sections are reached through their parent.
SECTION_CASES = {
    "model": (ModelConfig(hf_path="/m"), ModelConfig(hf_path="/m", moe=MoEConfig(aux_loss_coeff=-0.5)),
              "model.moe.aux_loss_coeff: must be >= 0, got -0.5"),
    "parallel": (ParallelConfig(), ParallelConfig(expert=0), "parallel.expert: must be >= 1, got 0"),
    "data": (DataConfig(train_files=["a"]), DataConfig(train_files=["a"], max_prompt_length=0),
             "data.max_prompt_length: must be >= 1, got 0"),
    "rollout": (RolloutConfig(), RolloutConfig(sglang=SGLangConfig(tp_per_server=0)),
                "rollout.sglang.tp_per_server: must be >= 1"),
    "algorithm": (AlgorithmConfig(), AlgorithmConfig(eps_low=1.5), "algorithm.eps_low: must be in [0, 1), got 1.5"),
    "reward": (RewardConfig(), RewardConfig(format=FormatRewardConfig(pattern="(")),
               "reward.format.pattern: not a regular expression"),
    "optim": (OptimConfig(), OptimConfig(lr=math.inf), "optim.lr: must be a finite number, got inf"),
    "warm_start": (WarmStartConfig(), WarmStartConfig(stop_at_accuracy=math.nan),
                   "warm_start.stop_at_accuracy: must be a finite number, got nan"),
    "trainer": (TrainerConfig(), TrainerConfig(mini_batch_size=5),
                "trainer.mini_batch_size: must divide trainer.train_batch_size (512), got 5"),
    "eval": (EvalConfig(), EvalConfig(log_generations=-1), "eval.log_generations: must be >= 0"),
}


def _runnable() -> DAPOConfig:
    return DAPOConfig(**{name: good for name, (good, _, _) in SECTION_CASES.items()})


@pytest.mark.parametrize("name", sorted(SECTION_CASES))
def test_each_section_checks_itself_and_names_the_full_key(name):
    good, bad, message = SECTION_CASES[name]
    good.validate()  # control: the same section without the bad value passes its own check
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        bad.validate()


@pytest.mark.parametrize("name", sorted(SECTION_CASES))
def test_the_whole_config_runs_every_sections_check(name):
    _, bad, message = SECTION_CASES[name]
    assert _runnable().validate() is not None  # control: every good section together passes
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        dataclasses.replace(_runnable(), **{name: bad}).validate()


def test_every_section_has_a_check_and_a_case_above():
    """A section added to DAPOConfig without a ``validate`` of its own (or without a bad value tried above) fails
    here rather than going unchecked."""
    sections = {item.name: item for item in dataclasses.fields(DAPOConfig)}
    assert set(SECTION_CASES) == set(sections)
    for name, item in sections.items():
        assert callable(getattr(item.default_factory, "validate", None)), f"{name} has no validate()"


def test_cross_section_rules_are_the_whole_configs():
    """overlong_buffer_len is bounded by rollout.max_response_length: the algorithm section alone cannot know it."""
    algorithm = AlgorithmConfig(overlong_buffer_len=30_000)
    algorithm.validate()
    with pytest.raises(ConfigError, match="^algorithm.overlong_buffer_len: must be in "
                                          r"\(0, rollout.max_response_length=20480\], got 30000"):
        dataclasses.replace(_runnable(), algorithm=algorithm).validate()
    dataclasses.replace(_runnable(), algorithm=algorithm, rollout=RolloutConfig(max_response_length=30_000)).validate()
    with pytest.raises(ConfigError, match="^warm_start.enabled: needs reference solutions"):
        dataclasses.replace(_runnable(), warm_start=WarmStartConfig(enabled=True)).validate()
    dataclasses.replace(_runnable(), warm_start=WarmStartConfig(enabled=True),
                        data=DataConfig(source="synthetic")).validate()  # control
