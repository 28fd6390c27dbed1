"""Configuration and types shared by the scheduler daemon, the workers and the clients."""

from shared.config import SchedulerConfig, load_config
from shared.errors import ConfigError, InvalidRequestError
from shared.sampling import SamplingParams

__all__ = [
    "ConfigError",
    "InvalidRequestError",
    "SamplingParams",
    "SchedulerConfig",
    "load_config",
]
