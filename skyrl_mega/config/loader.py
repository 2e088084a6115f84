"""Composes a config with Hydra: the typed schema, one recipe, command-line overrides.

In: a recipe (a YAML path, relative to the cwd or to the repo; or `<family>/<size>` under
recipes/; or None for the schema defaults) and Hydra override strings (`key=value`,
`+key=value` to add a dict entry, `~key` to drop one / reset a field to its default).
Out: a typed SkyrlConfig (OmegaConf DictConfig), or a one-line ConfigError naming the key.

The schema (schema.SkyrlConfig) is the primary config, registered in Hydra's ConfigStore as
`skyrl_mega`. A recipe `<dir>/<family>/<size>.yaml` is option `<size>` of the config group
`<family>` in the config dir `<dir>` (recipes/ for ours; any directory for a user's own), picked
with the override `+<family>@_global_=<size>`, so its keys merge over the schema at the root;
a recipe may list sibling recipes in a Hydra defaults list. Hydra's compose API
(initialize_config_dir + compose) then applies the overrides with Hydra's grammar. The result
is merged once more onto the schema, so nothing outside it survives (`+train.foo=1` is an
unknown key like `train.foo=1`).
"""

from __future__ import annotations

import os
import re
from typing import Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .schema import SkyrlConfig
from .validate import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES_DIR = os.path.join(REPO, "recipes")
SCHEMA_NAME = "skyrl_mega"
_GROUP = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")  # Hydra's ID token: a config group name


def register_schema() -> None:
    """Stores the schema in Hydra's ConfigStore as the primary config `skyrl_mega`."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=SkyrlConfig)


def resolve_recipe(recipe: str) -> str:
    """The recipe's absolute path: `recipe` as a file (from the cwd), else under the repo or
    recipes/ (`qwen3_moe/tiny_cpu`, `.yaml` optional). ConfigError when none exists."""
    names = [recipe] if recipe.endswith((".yaml", ".yml")) else [recipe, recipe + ".yaml"]
    for base in ("", REPO, RECIPES_DIR):  # the cwd first
        for name in names:
            path = os.path.join(base, name) if base else name
            if os.path.isfile(path):
                return os.path.abspath(path)
    raise ConfigError(f"recipe {recipe!r} not found (looked from {os.getcwd()}, {REPO} and {RECIPES_DIR})")


def recipe_group(path: str) -> tuple[str, str, str]:
    """(config dir, group, option) of a recipe file: <config dir>/<group>/<option>.yaml."""
    group_dir, fname = os.path.split(os.path.abspath(path))
    config_dir, group = os.path.split(group_dir)
    option = os.path.splitext(fname)[0]
    if not _GROUP.match(group) or not config_dir:
        raise ConfigError(f"recipe {path}: its directory {group!r} is its Hydra config group and must be a "
                          "plain name (letters, digits, _ or -, not starting with a digit); move the recipe "
                          "into such a directory, e.g. myrecipes/<family>/<size>.yaml")
    return config_dir, group, option


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0].strip() if str(e).strip() else type(e).__name__


_BOILERPLATE = ("full_key:", "reference_type=", "object_type=", "See https://hydra.cc", "Available options",
                "Config search path", "provider=")


def _one_line(e: BaseException, path: Optional[str]) -> str:
    """One line from a Hydra / OmegaConf error: where (recipe or overrides), the key, what is
    wrong and Hydra's hint, without OmegaConf's object dump."""
    cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else None
    lines = [ln.strip() for x in (e, cause) if x is not None for ln in str(x).splitlines() if ln.strip()]
    key = getattr(cause, "full_key", None) or next(
        (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    text = [ln for ln in lines if not ln.startswith(_BOILERPLATE) and not ln.startswith(("\t", "provider"))]
    in_recipe = bool(path) and bool(text) and text[0].startswith("In '")
    where = f"recipe {path}" if in_recipe else "the overrides"
    if in_recipe:  # "In 'qwen3_moe/x': ConfigKeyError raised while composing config:" names only the option
        text = text[1:]
    if any(" not in '" in ln for ln in text):  # the schema has no such key: `+key` would not help either
        text = [f"unknown key '{key}'"] + [ln for ln in text if " not in '" in ln]
    elif key and in_recipe:
        text = [f"at '{key}'"] + text
    if getattr(e, "override", None):  # OverrideParseException names the override only here
        text = [f"cannot parse {e.override!r}"] + text
    if any("--multirun" in ln for ln in text):
        text = [text[0], "use key=[a,b] for a list or quote the value; sweeps (a=1,2) run with "
                "`skyrl-mega validate -m` (train runs one job at a time)"]
    return f"config error in {where}: " + "; ".join(ln.rstrip(".:") for ln in text)


def _compose(path: Optional[str], overrides: list[str]):
    from hydra import compose, initialize_config_dir

    register_schema()
    config_dir, selection = RECIPES_DIR, []
    if path:
        config_dir, group, option = recipe_group(path)
        selection = [f"+{group}@_global_={option}"]
    with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="skyrl_mega"):
        return compose(config_name=SCHEMA_NAME, overrides=selection + overrides)


def load_config(recipe: Optional[str] = None, overrides: Sequence[str] = ()) -> SkyrlConfig:
    """Schema <- recipe <- overrides, composed by Hydra. Raises a one-line ConfigError."""
    from hydra.errors import HydraException
    from yaml import YAMLError

    overrides = list(overrides)
    bad = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if bad:
        raise ConfigError(f"overrides must look like key=value, +key=value or ~key, got {bad}")
    path = resolve_recipe(recipe) if recipe else None
    try:
        cfg = _compose(path, overrides)
    except YAMLError as e:
        raise ConfigError(f"recipe {path} is not valid YAML: {' '.join(str(e).split())}") from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_one_line(e, path)) from None
    try:  # `+key=value` adds keys in Hydra's open mode: the schema has the last word
        return OmegaConf.merge(OmegaConf.structured(SkyrlConfig), OmegaConf.to_container(cfg))
    except OmegaConfBaseException as e:
        raise ConfigError(f"config error in the overrides: unknown key '{e.full_key}'; {_first_line(e)}") from None
