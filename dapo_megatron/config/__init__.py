"""The run configuration: the typed schema with the paper's defaults (:mod:`.schema`) and how a run's YAML file and
dotted overrides become one validated :class:`DAPOConfig` (:mod:`.loading`)."""

from dapo_megatron.config.loading import config_to_dict, load_config, parse_override, save_config
from dapo_megatron.config.schema import (
    AlgorithmConfig,
    ConfigError,
    DAPOConfig,
    DataConfig,
    EmbeddedConfig,
    EvalConfig,
    FormatRewardConfig,
    MlflowConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    SGLangConfig,
    SyntheticDataConfig,
    TinyModelConfig,
    TrainerConfig,
    TrainSourceConfig,
    WandbConfig,
    WarmStartConfig,
)

__all__ = [
    "AlgorithmConfig", "ConfigError", "DAPOConfig", "DataConfig", "EmbeddedConfig", "EvalConfig", "FormatRewardConfig",
    "MlflowConfig", "ModelConfig", "MoEConfig", "OptimConfig", "ParallelConfig", "RewardConfig", "RolloutConfig",
    "SGLangConfig", "SyntheticDataConfig", "TinyModelConfig", "TrainSourceConfig", "TrainerConfig", "WandbConfig",
    "WarmStartConfig", "config_to_dict", "load_config", "parse_override", "save_config",
]
