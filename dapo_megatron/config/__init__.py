"""The run configuration: the typed schema with the paper's defaults (:mod:`.schema`, one module per section) and how
a run's YAML file and dotted overrides become one validated :class:`DAPOConfig` (:mod:`.loading`)."""

from dapo_megatron.config.algorithm import AlgorithmConfig
from dapo_megatron.config.data import DataConfig, SyntheticDataConfig, TrainSourceConfig
from dapo_megatron.config.errors import ConfigError
from dapo_megatron.config.eval import EvalConfig
from dapo_megatron.config.loading import config_to_dict, load_config, parse_override, save_config
from dapo_megatron.config.model import LoRAConfig, ModelConfig, MoEConfig, TinyModelConfig
from dapo_megatron.config.optim import OptimConfig
from dapo_megatron.config.parallel import ParallelConfig
from dapo_megatron.config.reward import FormatRewardConfig, RewardConfig
from dapo_megatron.config.rollout import EmbeddedConfig, RolloutConfig, SGLangConfig
from dapo_megatron.config.schema import DAPOConfig
from dapo_megatron.config.trainer import MlflowConfig, TrainerConfig, WandbConfig
from dapo_megatron.config.warm_start import WarmStartConfig

__all__ = [
    "AlgorithmConfig", "ConfigError", "DAPOConfig", "DataConfig", "EmbeddedConfig", "EvalConfig", "FormatRewardConfig",
    "LoRAConfig", "MlflowConfig", "ModelConfig", "MoEConfig", "OptimConfig", "ParallelConfig", "RewardConfig",
    "RolloutConfig", "SGLangConfig", "SyntheticDataConfig", "TinyModelConfig", "TrainSourceConfig", "TrainerConfig",
    "WandbConfig", "WarmStartConfig", "config_to_dict", "load_config", "parse_override", "save_config",
]
