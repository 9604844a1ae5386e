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
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RolloutConfig,
    SGLangConfig,
    SyntheticDataConfig,
    TinyModelConfig,
    TrainerConfig,
    WarmStartConfig,
)

__all__ = [
    "AlgorithmConfig", "ConfigError", "DAPOConfig", "DataConfig", "EmbeddedConfig", "EvalConfig", "ModelConfig",
    "OptimConfig", "ParallelConfig", "RolloutConfig", "SGLangConfig", "SyntheticDataConfig", "TinyModelConfig",
    "TrainerConfig", "WarmStartConfig", "config_to_dict", "load_config", "parse_override", "save_config",
]
