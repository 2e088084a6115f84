"""Reward functions: a registry of rule-based scorers.

In: the response text, the ground truth and the sample's metadata. Out: a float in [0, 1].
Register your own with `@register_reward("name")` in a module, or name one by import path
(`module:function`); pick it per sample by `data_source` (or the config's default).
Built in: `gsm8k` (final number), `digits` (the demo's), `math_verify` (math-verify's
extraction and equivalence, math_reward.py; imported on first use). The trainer calls them in
worker processes with a time limit per call (reward_pool.py), so a reward is found there by its
import path (`reward_spec`).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Union

RewardFn = Callable[[str, Any, dict], float]
# name -> function, or the `module:function` path of one imported on first use
REWARDS: dict[str, Union[RewardFn, str]] = {"math_verify": "skyrl_mega.data.math_reward:math_verify_reward"}


def register_reward(name: str, *, override: bool = False):
    def wrap(fn: RewardFn) -> RewardFn:
        if name in REWARDS and not override:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = fn
        return fn

    return wrap


def get_reward(name: str) -> RewardFn:
    """A registered name, or `package.module:function` (imported): a reward of your own without
    touching this package, e.g. `data.reward=my_rewards:exact_match`."""
    target = REWARDS.get(name, name)
    if callable(target):
        return target
    if ":" in target:
        import importlib

        module, _, attr = target.partition(":")
        try:
            fn = importlib.import_module(module)
            for part in attr.split("."):
                fn = getattr(fn, part)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward {name!r}: cannot import {attr!r} from {module!r} ({e})") from None
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable")
        return fn
    raise ValueError(f"unknown reward {name!r}; registered: {sorted(REWARDS)} (or give module:function)")


def reward_spec(name: str) -> str:
    """The `module:function` path another process imports `name` by (a reward worker)."""
    target = REWARDS.get(name, name)
    if not callable(target):
        if ":" not in target:
            get_reward(name)  # raises: unknown
        return target
    module, qualname = target.__module__, target.__qualname__
    if module == "__main__" or "<locals>" in qualname:
        raise ValueError(f"reward {name!r} is defined in {module}.{qualname}, which a reward worker process cannot "
                         "import: define it at the top level of a module")
    return f"{module}:{qualname}"


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_final_number(text: str) -> str | None:
    """GSM8K style: the number after '####' if present, else the last number in the text."""
    if "####" in text:
        text = text.split("####")[-1]
    found = _NUMBER.findall(text)
    if not found:
        return None
    return found[-1].replace(",", "").rstrip(".")


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a.strip() == b.strip()


@register_reward("gsm8k")
def gsm8k_reward(response: str, ground_truth: Any, meta: dict) -> float:
    """1.0 when the response's final number equals the ground truth's final number."""
    truth = extract_final_number(str(ground_truth)) if ground_truth is not None else None
    got = extract_final_number(response)
    return float(truth is not None and got is not None and _same_number(got, truth))


@register_reward("digits")
def digits_reward(response: str, ground_truth: Any, meta: dict) -> float:
    """Dense synthetic reward for the demo: the fraction of non-space characters that are the
    digit named by the ground truth (e.g. "7"), so a random policy starts near 0 and a policy
    that learns to answer "777..." reaches 1."""
    chars = [c for c in response if not c.isspace()]
    if not chars:
        return 0.0
    target = str(ground_truth)
    return sum(c == target for c in chars) / len(chars)
