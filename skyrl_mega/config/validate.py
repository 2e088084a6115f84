"""Fail-fast config validation, run before any process group starts.

In: a SkyrlConfig and the launcher's world size. Out: None, or one ConfigError whose message
lists every problem found, each naming the config key and how to fix it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "model.spec": ("auto", "te", "local"),
    "optim.lr_decay_style": ("constant", "cosine"),
    "placement": ("colocated", "disaggregated"),
    "rollout.weight_transport": ("auto", "shm", "nccl", "cuda_ipc"),
}


def _registry_problems(cfg) -> list[str]:
    """Names that must exist in the algorithm / reward registries."""
    from skyrl_mega import algorithms
    from skyrl_mega.data.rewards import REWARDS

    a = cfg.algorithm
    checks = [("algorithm.advantage", a.advantage, algorithms.ADVANTAGE_ESTIMATORS),
              ("algorithm.policy_loss", a.policy_loss, algorithms.POLICY_LOSSES),
              ("data.reward", cfg.data.reward, REWARDS)]
    if a.off_policy:
        checks.append(("algorithm.off_policy", a.off_policy, algorithms.OFF_POLICY_CORRECTIONS))
    checks += [(f"data.reward_by_source.{k}", v, REWARDS) for k, v in cfg.data.reward_by_source.items()]
    return [f"{key}={val!r} is not registered; choose one of {sorted(reg)}" for key, val, reg in checks
            if val not in reg and not (reg is REWARDS and _importable_reward(val))]


def _importable_reward(name: str) -> bool:
    """A reward given as `module:function` (skyrl_mega.data.rewards.get_reward imports it)."""
    from skyrl_mega.data.rewards import get_reward

    if ":" not in name:
        return False
    try:
        get_reward(name)
        return True
    except ValueError:
        return False


class ConfigError(ValueError):
    """A bad configuration; the message says which key and why."""


def read_hf_config(path: Optional[str]) -> Optional[dict[str, Any]]:
    if not path:
        return None
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        return None
    with open(cfg_file) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg


def num_experts(hf: dict[str, Any]) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key):
            return int(hf[key])
    return 0


def _get(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate_config(cfg, world_size: Optional[int] = None, hf: Optional[dict] = None) -> None:
    """Raises ConfigError listing every problem; returns None when the config is usable."""
    problems: list[str] = []
    p = cfg.parallel
    world = world_size or p.world_size or 1

    for key, allowed in CHOICES.items():
        if _get(cfg, key) not in allowed:
            problems.append(f"{key}={_get(cfg, key)!r} is not one of {list(allowed)}")
    for key in ("tp", "pp", "cp", "ep"):
        if getattr(p, key) < 1:
            problems.append(f"parallel.{key} must be >= 1 (got {getattr(p, key)})")
    etp = p.etp if p.etp is not None else p.tp
    model_parallel = p.tp * p.pp * p.cp
    if model_parallel >= 1 and world % model_parallel:
        problems.append(
            f"world size {world} is not divisible by tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {model_parallel}"
        )
    if etp * p.ep * p.pp >= 1 and world % (etp * p.ep * p.pp):
        problems.append(
            f"world size {world} is not divisible by etp*ep*pp = {etp}*{p.ep}*{p.pp} = {etp * p.ep * p.pp}"
        )

    if not cfg.model.path:
        problems.append("model.path is missing: set model.path=<HF checkpoint dir>")
    elif not os.path.isdir(cfg.model.path) and not cfg.model.make_tiny_if_missing:
        problems.append(f"model.path={cfg.model.path!r} does not exist")

    hf = hf if hf is not None else read_hf_config(cfg.model.path)
    if hf is not None:
        experts = num_experts(hf)
        if experts and experts % p.ep:
            problems.append(f"{experts} experts are not divisible by parallel.ep={p.ep}")
        if not experts and p.ep > 1:
            problems.append(f"parallel.ep={p.ep} but the model has no experts")
        sp = p.sequence_parallel if p.sequence_parallel is not None else p.tp > 1
        if experts and p.tp > 1 and not sp:
            problems.append(
                f"parallel.tp={p.tp} with a MoE model needs sequence parallel: "
                "set parallel.sequence_parallel=true (or leave it unset)"
            )
        layers = hf.get("num_hidden_layers", 0)
        if layers and layers % p.pp:
            problems.append(f"{layers} layers are not divisible by parallel.pp={p.pp}")
        heads, kv = hf.get("num_attention_heads", 0), hf.get("num_key_value_heads", 0)
        if heads and heads % p.tp:
            problems.append(f"{heads} attention heads are not divisible by parallel.tp={p.tp}")
        if kv and kv % p.tp:
            problems.append(f"{kv} key/value heads are not divisible by parallel.tp={p.tp}")

    problems += _registry_problems(cfg)
    r = cfg.rollout
    if r.n_samples_per_prompt < 1 or r.prompts_per_step < 1 or r.max_tokens < 1:
        problems.append("rollout.prompts_per_step, n_samples_per_prompt and max_tokens must be >= 1")
    if cfg.algorithm.advantage in ("grpo", "rloo", "grpo_no_std", "maxrl") and r.n_samples_per_prompt < 2:
        problems.append(f"algorithm.advantage={cfg.algorithm.advantage} compares samples of one prompt: "
                        "set rollout.n_samples_per_prompt >= 2")
    if r.sleep_level not in (1, 2):
        problems.append(f"rollout.sleep_level must be 1 or 2 (got {r.sleep_level})")
    t = cfg.train
    if t.global_batch_size < 1 or t.micro_batch_size < 1:
        problems.append("train.global_batch_size and train.micro_batch_size must be >= 1")
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
