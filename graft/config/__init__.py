"""A run's config: the typed tree (`schema`) and how it is read from YAML and overrides (`loading`).

Import from here: `from graft.config import GraftConfig, load_config`.
"""

from graft.config.base import ALL_LINEAR, LOOPBACK_HOSTS, VLLM_LORA_RANKS, ConfigError, is_loopback_url, module_list
from graft.config.data import DataConfig, RewardSpec
from graft.config.loading import config_to_yaml, load_config, save_config
from graft.config.schema import (
    DistConfig,
    GraftConfig,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
    SyncConfig,
    TrainConfig,
)

__all__ = [
    "ALL_LINEAR", "LOOPBACK_HOSTS", "VLLM_LORA_RANKS", "ConfigError", "DataConfig", "DistConfig", "GraftConfig",
    "LoraConfig", "ModelConfig", "RewardSpec", "RolloutConfig", "SyncConfig", "TrainConfig", "config_to_yaml",
    "is_loopback_url", "load_config", "module_list", "save_config",
]
