"""The one configuration schema: typed dataclasses whose defaults are the paper's recipe (Qwen2.5-32B, DAPO).

A run is configured by, in order of precedence:  command-line dotted overrides (``rollout.n_samples=8``)  >  a YAML
file (``examples/*.yaml``)  >  these defaults. Unknown keys and badly typed values are rejected with the dotted key
named (:mod:`dapo_megatron.config.loading`). The resolved config is written to the run directory as
``config.yaml``.

Where the paper / the published recipe fixes a number, the default is that number:
clip ε_low/ε_high 0.2/0.28, dual-clip c = 10, token-mean loss, no KL, G = 16 samples per prompt, 512 prompts per step,
1536 prompts per generation round, at most 10 generation rounds, mini-batch 32 prompts (16 updates per step),
max prompt 2048 / response 20480 tokens, overlong buffer 4096 with factor 1.0, lr 1e-6 with 10 warmup steps,
weight decay 0.1, grad clip 1.0, rollout temperature 1.0 / top-p 1.0, validation top-p 0.7 with avg@32.

Each section is a module of its own with the checks that read it alone (:mod:`.model`, :mod:`.parallel`,
:mod:`.data`, :mod:`.rollout`, :mod:`.algorithm`, :mod:`.reward`, :mod:`.optim`, :mod:`.warm_start`, :mod:`.trainer`,
:mod:`.eval`); :class:`DAPOConfig` composes them and holds the rules that read two sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from dapo_megatron.config.algorithm import SGLANG_ROUTING_FLAG as ROUTING_FLAG
from dapo_megatron.config.algorithm import AlgorithmConfig
from dapo_megatron.config.data import DataConfig
from dapo_megatron.config.errors import require
from dapo_megatron.config.eval import EvalConfig
from dapo_megatron.config.model import ModelConfig
from dapo_megatron.config.optim import OptimConfig
from dapo_megatron.config.parallel import ParallelConfig
from dapo_megatron.config.reward import RewardConfig
from dapo_megatron.config.rollout import RolloutConfig
from dapo_megatron.config.trainer import TrainerConfig
from dapo_megatron.config.warm_start import WarmStartConfig


@dataclass
class DAPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> "DAPOConfig":
        """Each section's own checks (in the order of the fields above), then the rules that read two sections.
        Returns self."""
        for section in fields(self):
            getattr(self, section.name).validate()
        a, r = self.algorithm, self.rollout
        require(0 < a.overlong_buffer_len <= r.max_response_length or not a.overlong_penalty,
                "algorithm.overlong_buffer_len",
                f"must be in (0, rollout.max_response_length={r.max_response_length}], got {a.overlong_buffer_len}")
        dense_tiny = self.model.source == "tiny" and self.model.tiny.arch != "qwen3_moe"
        require(not (dense_tiny and self.parallel.expert > 1), "parallel.expert",
                f"expert parallelism needs a mixture-of-experts model (model.tiny.arch: qwen3_moe), "
                f"got {self.parallel.expert}")
        require(not (dense_tiny and a.moe_routing_replay != "none"), "algorithm.moe_routing_replay",
                f"{a.moe_routing_replay} needs a mixture-of-experts model (model.tiny.arch: qwen3_moe)")
        if a.moe_routing_replay == "replay_rollout":
            self._validate_rollout_routing()
        require(not self.warm_start.enabled or self.data.source == "synthetic" or self.warm_start.traces is not None,
                "warm_start.enabled", "needs reference solutions: data.source = synthetic, or warm_start.traces")
        return self

    def _validate_rollout_routing(self) -> None:
        """R3 needs every trained token's routing from the engine, routed by the weights that sampled it."""
        r, key = self.rollout, "algorithm.moe_routing_replay"
        require(r.engine == "embedded" or r.sglang.urls or ROUTING_FLAG in r.sglang.extra_server_args, key,
                f"replay_rollout needs the servers' routing: add {ROUTING_FLAG} to rollout.sglang.extra_server_args "
                f"(without it rollout.engine: sglang servers return none)")
        require(not (r.mode == "async" and r.partial_rollouts), key,
                "replay_rollout cannot replay a partial rollout: a response continued across a weight update had its "
                "earlier tokens re-routed by the new weights; set rollout.partial_rollouts: false")
