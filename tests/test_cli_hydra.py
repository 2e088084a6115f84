"""Recipes are Hydra configs: the schema in Hydra's ConfigStore, one config group per model
family, composed with Hydra's compose API; Hydra's override grammar, `--cfg job`, and
`validate -m` sweeps. Checked against Hydra itself and against the recipe files as YAML."""

import os
import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from skyrl_mega import cli
from skyrl_mega.config import ConfigError, load_config

RECIPE = cli.DEFAULT_RECIPE
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _recipe_yaml():
    with open(RECIPE) as f:
        return yaml.safe_load(f)


def test_recipe_is_an_option_of_its_family_group_in_plain_hydra():
    """What a Hydra user writes (`+qwen3_moe=tiny_cpu` over the stored schema) gives the
    same config as load_config, and the recipe's own values come through."""
    from hydra import compose, initialize_config_dir

    ours = load_config(RECIPE, ["train.steps=3"])
    with initialize_config_dir(config_dir=os.path.join(REPO, "recipes"), version_base="1.3"):
        theirs = compose("skyrl_mega", overrides=["+qwen3_moe=tiny_cpu", "train.steps=3"])
    assert OmegaConf.to_container(ours) == OmegaConf.to_container(theirs)
    raw = _recipe_yaml()
    assert ours.parallel.ep == raw["parallel"]["ep"] and ours.optim.lr == raw["optim"]["lr"]
    assert ours.train.steps == 3 and ours.optim.weight_decay == 0.0  # override; schema default


def test_recipe_outside_recipes_from_another_cwd_with_a_defaults_list(tmp_path, monkeypatch):
    fam = tmp_path / "mine" / "myfamily"
    fam.mkdir(parents=True)
    (fam / "base.yaml").write_text("train:\n  steps: 5\n  seed: 9\nrollout:\n  max_tokens: 4\n")
    (fam / "long.yaml").write_text("defaults:\n  - base\n  - _self_\ntrain:\n  steps: 7\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config("../mine/myfamily/long.yaml", ["rollout.max_tokens=6"])
    assert (cfg.train.steps, cfg.train.seed, cfg.rollout.max_tokens) == (7, 9, 6)
    # ours by group/option name, from any cwd
    assert load_config("qwen3_moe/tiny_cpu").parallel.ep == _recipe_yaml()["parallel"]["ep"]
    with pytest.raises(ConfigError, match="recipe 'qwen3_moe/nope' not found"):
        load_config("qwen3_moe/nope")


def test_override_grammar_add_remove_and_unknown_keys(tmp_path):
    cfg = load_config(RECIPE, ["+algorithm.policy_loss_kwargs.eps_low=0.1", "+data.reward_by_source.math=gsm8k",
                               "+data.reward_by_source.toy=digits", "~data.reward_by_source.toy"])
    assert dict(cfg.algorithm.policy_loss_kwargs) == {"eps_low": 0.1}
    assert dict(cfg.data.reward_by_source) == {"math": "gsm8k"}
    with pytest.raises(ConfigError, match=r"use \+algorithm.policy_loss_kwargs.eps_low=0.1"):
        load_config(RECIPE, ["algorithm.policy_loss_kwargs.eps_low=0.1"])
    for bad in (["+train.foo=1"], ["train.foo=1"]):  # `+` cannot smuggle in keys the schema lacks
        with pytest.raises(ConfigError) as e:
            load_config(RECIPE, bad)
        assert "unknown key 'train.foo'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="validate -m"):
        load_config(RECIPE, ["parallel.ep=1,2"])
    recipe = tmp_path / "fam" / "typo.yaml"
    recipe.parent.mkdir()
    recipe.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(recipe))
    assert str(e.value) == (f"config error in recipe {recipe}: unknown key 'train.stepz'; "
                            "Key 'stepz' not in 'TrainConfig'")


def test_cfg_job_prints_the_composed_config_and_launches_nothing(tmp_path):
    """From another cwd, as a user runs it; --entry names a module that cannot start."""
    out = subprocess.run(
        [sys.executable, "-m", "skyrl_mega.cli", "train", "--recipe", os.path.relpath(RECIPE, tmp_path),
         "--cfg", "job", "train.steps=3", "+algorithm.off_policy_kwargs.clip=2.0", "--entry", "no_such_module"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    expected = OmegaConf.to_container(load_config(RECIPE, ["train.steps=3", "+algorithm.off_policy_kwargs.clip=2.0"]))
    assert printed == expected
    assert printed["train"]["steps"] == 3 and printed["rollout"]["max_tokens"] == _recipe_yaml()["rollout"]["max_tokens"]
    assert not (tmp_path / "runs").exists()  # nothing launched, nothing written


def test_validate_multirun_sweeps_every_combination(tiny_qwen3_moe, capsys):
    rc = cli.main(["validate", "--recipe", RECIPE, "-m", f"model.path={tiny_qwen3_moe}",
                   "parallel.ep=1,2,3", "train.steps=2,4"])
    out, err = capsys.readouterr()
    assert rc == 2
    for i, (ep, steps) in enumerate([(e, s) for e in (1, 2, 3) for s in (2, 4)]):
        label = f"[{i + 1}/6] model.path={tiny_qwen3_moe} parallel.ep={ep} train.steps={steps}"
        assert label in (out if ep != 3 else err), label
    assert out.count("config OK for world size 2") == 4
    assert err.count("8 experts are not divisible by parallel.ep=3") == 2 and "2 of 6 configs are invalid" in err
