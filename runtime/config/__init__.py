"""Service configuration: TOML in, frozen dataclasses out, every key checked.

``sections`` holds the dataclasses (what each key means), ``loading`` reads a file and checks
every key's name and type, ``checks`` the values and the keys that depend on each other.
"""

from __future__ import annotations

from runtime.config.loading import config_to_dict, load_config, parse_config
from runtime.config.sections import (
    CacheConfig,
    Config,
    ConfigError,
    DistributedConfig,
    HttpConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    WorkerConfig,
    is_loopback,
    split_host_port,
)

__all__ = ["CacheConfig", "Config", "ConfigError", "DistributedConfig", "HttpConfig", "ModelConfig", "SchedulerConfig",
           "ServerConfig", "WorkerConfig", "config_to_dict", "is_loopback", "load_config", "parse_config",
           "split_host_port"]
