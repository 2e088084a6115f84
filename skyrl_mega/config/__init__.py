"""Config: typed schema, YAML loading with overrides, fail-fast validation."""

from .loader import load_config
from .schema import SkyrlConfig
from .validate import ConfigError, validate_config

__all__ = ["ConfigError", "SkyrlConfig", "load_config", "validate_config"]
