"""Loads a recipe YAML onto the structured schema, then applies `key=value` overrides.

In: a recipe path (or None for the schema defaults) and override strings.
Out: a typed SkyrlConfig (OmegaConf object), or a ConfigError naming an unknown key.
"""

from __future__ import annotations

from typing import Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from .schema import SkyrlConfig
from .validate import ConfigError


def register_with_hydra() -> None:
    """Makes the schema available to @hydra.main apps as config name 'skyrl_mega'."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="skyrl_mega", node=SkyrlConfig)


def load_config(recipe: Optional[str] = None, overrides: Sequence[str] = ()) -> SkyrlConfig:
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key=value, got {bad}")
    cfg = OmegaConf.structured(SkyrlConfig)
    layers = [(recipe, lambda: OmegaConf.load(recipe))] if recipe else []
    layers.append(("command-line overrides", lambda: OmegaConf.from_dotlist(list(overrides))))
    for where, make in layers:
        try:
            cfg = OmegaConf.merge(cfg, make())
        except (ConfigKeyError, ValidationError) as e:
            key = getattr(e, "full_key", None)
            msg = str(e).splitlines()[0]
            raise ConfigError(f"config error in {where}" + (f" at '{key}'" if key else "") + f": {msg}") from None
    return cfg
