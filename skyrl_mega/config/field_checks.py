"""Per-field checks of a SkyrlConfig: ranges, choices, registered names, engine URLs.

In: a SkyrlConfig (and, for the URL probe, the network). Out: a list of problems, one line
each, naming the key, what is wrong and how to fix it. Names are checked against the
registries they are later looked up in (skyrl_mega.algorithms, skyrl_mega.data.rewards,
controller.placement.TRANSPORTS), option names against the registered functions' signatures.
validate.py runs these together with the model / parallel-layout checks.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")  # vLLM --dtype
GROUP_ADVANTAGES = ("grpo", "rloo", "grpo_no_std", "maxrl")  # compare samples of one prompt
SEQUENCE_LEVEL = ("gspo", "seq_tis", "mis")  # sequence-level losses / corrections
PROBE_TIMEOUT_S = 5.0


def get(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def at_least(cfg, low, keys: Iterable[str], strict: bool = False, optional: bool = False) -> list[str]:
    """`key >= low` (or `> low` when strict) for each key; optional keys may be null."""
    out = []
    for key in keys:
        v = get(cfg, key)
        if v is None and optional:
            continue
        if v is None or (v <= low if strict else v < low) or (isinstance(v, float) and math.isnan(v)):
            out.append(f"{key} must be {'>' if strict else '>='} {low}{' (or null)' if optional else ''}, got {v}")
    return out


def choice(key: str, value, allowed) -> list[str]:
    return [] if value in allowed else [f"{key}={value!r} is not one of {list(allowed)}"]


def _registered(key: str, name, registry) -> list[str]:
    return [] if name in registry else [f"{key}={name!r} is not registered; choose one of {sorted(registry)}"]


def _options(key: str, kwargs, fn, passed_by_caller=()) -> list[str]:
    """Every entry of a *_kwargs dict must be a keyword-only option of the function it goes to."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    known = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in passed_by_caller]
    return [f"{key}.{k}: {fn.__name__} has no option {k!r}; its options are {known}" for k in kwargs
            if k not in known]


def _reward(key: str, name: str) -> list[str]:
    """Registered or `module:function`; importable (also by a reward worker process)."""
    from skyrl_mega.data.rewards import REWARDS, get_reward, reward_spec

    if name not in REWARDS and ":" not in name:
        return [f"{key}={name!r} is not registered; choose one of {sorted(REWARDS)} (or give module:function)"]
    try:
        get_reward(name)
        reward_spec(name)
        return []
    except ValueError as e:
        return [f"{key}: {e}"]


def optim_problems(cfg) -> list[str]:
    o = cfg.optim
    out = at_least(cfg, 0, ["optim.lr", "optim.min_lr", "optim.weight_decay", "optim.clip_grad",
                            "optim.lr_warmup_steps"])
    out += at_least(cfg, 0, ["optim.adam_eps"], strict=True)
    if o.min_lr > o.lr:
        out.append(f"optim.min_lr={o.min_lr} is above optim.lr={o.lr}")
    out += [f"{k}={get(cfg, k)} must be in [0, 1)" for k in ("optim.adam_beta1", "optim.adam_beta2")
            if not 0 <= get(cfg, k) < 1]
    return out + choice("optim.lr_decay_style", o.lr_decay_style, ("constant", "cosine"))


def train_problems(cfg) -> list[str]:
    t = cfg.train
    out = at_least(cfg, 1, ["train.micro_batch_size", "train.steps", "train.mini_batches", "train.epochs"])
    out += at_least(cfg, 1, ["train.max_tokens_per_microbatch", "train.pad_packed_to"], optional=True)
    if t.recompute_granularity not in (None, "full"):
        out.append(f"train.recompute_granularity={t.recompute_granularity!r}: use null or 'full'")
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    if isinstance(t.mini_batches, int) and t.mini_batches > samples >= 1:
        out.append(f"train.mini_batches={t.mini_batches} is more than the {samples} samples of a rollout batch "
                   "(rollout.prompts_per_step x rollout.n_samples_per_prompt): lower it")
    return out


def algorithm_problems(cfg) -> list[str]:
    from skyrl_mega import algorithms as A

    a = cfg.algorithm
    out = _registered("algorithm.advantage", a.advantage, A.ADVANTAGE_ESTIMATORS)
    out += _registered("algorithm.policy_loss", a.policy_loss, A.POLICY_LOSSES)
    out += _registered("algorithm.reduction", a.reduction, A.REDUCTION_MODES)
    out += _registered("algorithm.kl_estimator", a.kl_estimator, A.KL_ESTIMATORS)
    if a.off_policy is not None:
        out += _registered("algorithm.off_policy", a.off_policy, A.OFF_POLICY_CORRECTIONS)
    for key, name, registry, kwargs, caller in (
            ("algorithm.advantage_kwargs", a.advantage, A.ADVANTAGE_ESTIMATORS, a.advantage_kwargs, ("group_size",)),
            ("algorithm.policy_loss_kwargs", a.policy_loss, A.POLICY_LOSSES, a.policy_loss_kwargs, ()),
            ("algorithm.off_policy_kwargs", a.off_policy, A.OFF_POLICY_CORRECTIONS, a.off_policy_kwargs, ())):
        if name in registry:
            out += _options(key, kwargs, registry[name], caller)
        elif kwargs and name is None:
            out.append(f"{key} is set but algorithm.off_policy is null")
    if a.reduction == "seq_mean_token_sum_norm" and a.max_len_norm is None:
        out.append("algorithm.reduction=seq_mean_token_sum_norm needs algorithm.max_len_norm > 0")
    out += at_least(cfg, 0, ["algorithm.max_len_norm"], strict=True, optional=True)
    out += choice("algorithm.old_logprobs", a.old_logprobs, ("rollout", "recompute"))
    out += at_least(cfg, 0, ["algorithm.kl_coef"]) + at_least(cfg, 0, ["algorithm.temperature"], strict=True)
    if a.kl_coef != 0 and not a.use_reference:
        out.append(f"algorithm.kl_coef={a.kl_coef} needs reference logprobs: set algorithm.use_reference=true "
                   "(or algorithm.kl_coef=0)")
    if a.ref_routing_replay and not a.use_reference:
        out.append("algorithm.ref_routing_replay needs algorithm.use_reference=true")
    if a.advantage in GROUP_ADVANTAGES and cfg.rollout.n_samples_per_prompt < 2:
        out.append(f"algorithm.advantage={a.advantage} compares samples of one prompt: "
                   "set rollout.n_samples_per_prompt >= 2")
    return out


def rollout_problems(cfg, probe: bool) -> list[str]:
    from skyrl_mega.controller.placement import TRANSPORTS

    r = cfg.rollout
    out = at_least(cfg, 1, [f"rollout.{k}" for k in ("num_servers", "prompts_per_step", "n_samples_per_prompt",
                                                    "max_tokens", "max_model_len", "kv_cache_gib",
                                                    "max_concurrency")])
    out += at_least(cfg, 0, ["rollout.temperature", "rollout.max_step_retries"])
    out += at_least(cfg, 0, ["rollout.startup_timeout_s", "rollout.request_deadline_s"], strict=True)
    if not 0 < r.top_p <= 1:
        out.append(f"rollout.top_p={r.top_p} must be in (0, 1]")
    out += choice("rollout.dtype", r.dtype, ENGINE_DTYPES)
    out += choice("rollout.sleep_level", r.sleep_level, (1, 2))
    out += choice("rollout.weight_transport", r.weight_transport, ("auto", *TRANSPORTS))
    out += choice("rollout.verify_sync", r.verify_sync, ("never", "first_last", "always"))
    if not out and not url_problems(list(r.external_urls), probe=False):
        # the transport the run would pick (engines on other hosts need nccl); reported also when
        # those engines do not answer yet
        from skyrl_mega.controller.placement import plan_placement

        try:
            plan_placement(cfg.placement, r)
        except ValueError as e:
            out.append(str(e))
    return out + url_problems(list(r.external_urls), probe) + engine_problems(cfg)


def engine_problems(cfg) -> list[str]:
    """GPU engine settings, and (for engines started here) the installed vLLM's version."""
    from skyrl_mega.rollout.engine_caps import UnsupportedEngine, installed

    r = cfg.rollout
    out = at_least(cfg, 1, ["rollout.engine_tp"]) + at_least(cfg, 1, ["rollout.max_num_seqs"], optional=True)
    if r.gpu_memory_utilization is not None and not 0 < r.gpu_memory_utilization <= 1:
        out.append(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1] (or null)")
    if r.engine_gpus and len(r.engine_gpus) != r.num_servers:
        out.append(f"rollout.engine_gpus names {len(r.engine_gpus)} GPU sets for rollout.num_servers="
                   f"{r.num_servers}: give one CUDA_VISIBLE_DEVICES string per engine, e.g. ['0', '1']")
    for i, g in enumerate(r.engine_gpus):
        ids = str(g).split(",")
        if not all(x.strip().isdigit() for x in ids) or len(ids) != r.engine_tp:
            out.append(f"rollout.engine_gpus[{i}]={g!r} must list rollout.engine_tp={r.engine_tp} GPU index(es), "
                       f"comma-separated")
    if not r.external_urls:
        try:
            installed()
        except UnsupportedEngine as e:
            out.append(f"rollout: {e}")
    return out


def url_problems(urls: list[str], probe: bool) -> list[str]:
    """Each URL well formed (http(s)://host[:port]); with probe, its /health answers 200."""
    out, good = [], []
    for i, url in enumerate(urls):
        try:
            u = urllib.parse.urlsplit(url)
            u.port  # noqa: B018  (raises on a bad port)
            ok = u.scheme in ("http", "https") and bool(u.hostname)
        except ValueError:
            ok = False
        if ok:
            good.append(url)
        else:
            out.append(f"rollout.external_urls[{i}]={url!r} is not an http(s)://host[:port] URL")
    if probe and good:
        from skyrl_mega.rollout.procs import http_status

        with ThreadPoolExecutor(max_workers=min(16, len(good))) as pool:
            codes = list(pool.map(lambda u: http_status(u.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S), good))
        for url, code in zip(good, codes):
            if code is None:
                out.append(f"rollout.external_urls: the engine at {url} is not reachable (nothing answered "
                           f"GET /health within {PROBE_TIMEOUT_S:.0f}s): start it or fix the URL")
            elif code != 200:
                out.append(f"rollout.external_urls: the engine at {url} is not healthy (GET /health answered {code})")
    return out


def data_problems(cfg, for_training: bool) -> list[str]:
    d = cfg.data
    out = at_least(cfg, 1, ["data.synthetic_size", "data.max_prompt_len", "data.reward_workers"])
    out += at_least(cfg, 0, ["data.reward_timeout_s"], strict=True)
    out += choice("data.synthetic", d.synthetic, (None, "digits"))
    out += _reward("data.reward", d.reward)
    for source, name in d.reward_by_source.items():
        out += _reward(f"data.reward_by_source.{source}", name)
    if for_training:
        if not d.train_path:
            out.append("data.train_path is missing: set data.train_path=<prompts .jsonl / .parquet> "
                       "(with data.synthetic=digits the demo task is written there)")
        elif not d.synthetic and not os.path.exists(d.train_path):
            out.append(f"data.train_path={d.train_path!r} does not exist (and data.synthetic is null)")
    return out


def checkpoint_problems(cfg) -> list[str]:
    c = cfg.checkpoint
    out = at_least(cfg, 0, ["checkpoint.every_n_steps", "checkpoint.keep_last", "checkpoint.hf_export_every_n_steps"])
    if c.resume not in ("auto", "none") and not os.path.isdir(c.resume):
        out.append(f"checkpoint.resume={c.resume!r} is neither auto, none nor an existing step directory")
    return out


def logging_problems(cfg) -> list[str]:
    if cfg.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        return [f"logging.wandb_project={cfg.logging.wandb_project!r} needs wandb: pip install wandb, "
                "or set logging.wandb_project=null"]
    return []


def top_level_problems(cfg) -> list[str]:
    out = choice("placement", cfg.placement, ("colocated", "disaggregated"))
    if not cfg.output_dir:
        out.append("output_dir is empty: set output_dir=<run directory>")
    return out


def field_problems(cfg, for_training: bool = False, probe_engines: bool = False) -> list[str]:
    sections: list[Any] = [optim_problems(cfg), train_problems(cfg), algorithm_problems(cfg),
                           rollout_problems(cfg, probe_engines), data_problems(cfg, for_training),
                           checkpoint_problems(cfg), logging_problems(cfg), top_level_problems(cfg)]
    return [p for section in sections for p in section]
