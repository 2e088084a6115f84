"""Advantage estimators for outcome rewards.

In:  ``rewards`` [B] float (one scalar per sampled response),
     ``response_mask`` [B, T] (bool or 0/1; True on response tokens),
     and the grouping: ``group_index`` [B] long (samples of the same prompt share
     a value; values need not be contiguous or sorted) *or* ``group_size`` (the
     batch is ``B // group_size`` consecutive groups).
Out: token-level advantages [B, T] in the rewards' float dtype: the sequence
     advantage broadcast over the response tokens, 0.0 at masked positions.

Shared rules:
  * Rewards of every row take part in the group statistics, whatever its mask
    (an all-pad row still counts as a sample of its group; it just gets no tokens).
  * A group whose rewards are all equal (zero variance, and every single-sample
    group) gets advantage exactly 0 -- never NaN.
  * These are batch statistics: call them once on the whole global batch (before
    splitting into micro-batches / ranks), never per micro-batch.

Registry: ``ADVANTAGE_ESTIMATORS``; add one with ``@register_advantage_estimator("name")``
on a function ``fn(rewards, response_mask, group_index=None, *, group_size=None, **kw) -> [B, T]``,
look one up with ``get_advantage_estimator("name")``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._registry import make_registry

ADVANTAGE_ESTIMATORS, register_advantage_estimator, get_advantage_estimator = make_registry(
    "advantage estimator"
)


def group_ids(
    batch_size: int,
    group_index: Tensor | None = None,
    group_size: int | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Contiguous group ids 0..G-1, shape [B], from ``group_index`` or ``group_size`` (exactly one)."""
    if (group_index is None) == (group_size is None):
        raise ValueError("pass exactly one of group_index or group_size")
    if group_size is not None:
        if group_size < 1 or batch_size % group_size != 0:
            raise ValueError(f"group_size={group_size} does not divide batch size {batch_size}")
        return torch.arange(batch_size, device=device) // group_size
    group_index = torch.as_tensor(group_index, device=device)
    if group_index.shape != (batch_size,):
        raise ValueError(f"group_index must have shape [{batch_size}], got {tuple(group_index.shape)}")
    return torch.unique(group_index, return_inverse=True)[1]


@dataclass(frozen=True)
class GroupStats:
    """Per-sample view ([B] each) of the statistics of the sample's group."""

    count: Tensor  # group size
    mean: Tensor  # group mean reward
    std: Tensor  # group std (Bessel-corrected if unbiased; 0 for single-sample groups)
    constant: Tensor  # bool: all rewards in the group are exactly equal


def group_stats(rewards: Tensor, ids: Tensor, unbiased: bool = True) -> GroupStats:
    """Group count/mean/std/constant-flag of ``rewards`` [B] under contiguous ``ids`` [B]."""
    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    zeros = rewards.new_zeros(num_groups)
    count = zeros.index_add(0, ids, torch.ones_like(rewards))
    mean = zeros.index_add(0, ids, rewards) / count
    dev = rewards - mean[ids]
    sq = zeros.index_add(0, ids, dev * dev)
    dof = (count - 1 if unbiased else count).clamp(min=1)
    std = (sq / dof).sqrt()
    hi = torch.full_like(zeros, -torch.inf).scatter_reduce(0, ids, rewards, "amax")
    lo = torch.full_like(zeros, torch.inf).scatter_reduce(0, ids, rewards, "amin")
    return GroupStats(count[ids], mean[ids], std[ids], (hi == lo)[ids])


def broadcast_to_tokens(seq_values: Tensor, response_mask: Tensor) -> Tensor:
    """[B] -> [B, T]: value on every response token, 0 at masked positions."""
    mask = response_mask.bool()
    if seq_values.shape != mask.shape[:1]:
        raise ValueError(f"expected [{mask.shape[0]}] values, got {tuple(seq_values.shape)}")
    return torch.where(mask, seq_values[:, None], torch.zeros((), dtype=seq_values.dtype, device=seq_values.device))


def _prepare(rewards: Tensor, response_mask: Tensor, group_index, group_size) -> tuple[Tensor, Tensor]:
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if rewards.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"expected rewards [B] and response_mask [B, T], got {tuple(rewards.shape)} and "
            f"{tuple(response_mask.shape)}"
        )
    return rewards, group_ids(rewards.shape[0], group_index, group_size, device=rewards.device)


def _zero_where(cond: Tensor, x: Tensor) -> Tensor:
    return torch.where(cond, torch.zeros_like(x), x)


@register_advantage_estimator("grpo")
def grpo_advantages(
    rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | None = None,
    *,
    group_size: int | None = None,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
    unbiased_std: bool = True,
) -> Tensor:
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + epsilon)``; ``A_i = r_i - mean_g`` if not ``norm_by_std``.

    ``std_g`` is Bessel-corrected (like ``torch.std``) unless ``unbiased_std=False``.
    Constant groups give 0.
    """
    rewards, ids = _prepare(rewards, response_mask, group_index, group_size)
    st = group_stats(rewards, ids, unbiased=unbiased_std)
    adv = rewards - st.mean
    if norm_by_std:
        adv = adv / (st.std + epsilon)
    return broadcast_to_tokens(_zero_where(st.constant, adv), response_mask)


@register_advantage_estimator("grpo_no_std")
def grpo_no_std_advantages(rewards, response_mask, group_index=None, *, group_size=None) -> Tensor:
    """GRPO without std normalisation (Dr.GRPO): ``A_i = r_i - mean_g``."""
    return grpo_advantages(rewards, response_mask, group_index, group_size=group_size, norm_by_std=False)


@register_advantage_estimator("rloo")
def rloo_advantages(
    rewards: Tensor, response_mask: Tensor, group_index: Tensor | None = None, *, group_size: int | None = None
) -> Tensor:
    """RLOO: ``A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1)`` (= n/(n-1) * (r_i - mean_g)).

    Single-sample groups (no other sample to form a baseline) and constant groups give 0.
    """
    rewards, ids = _prepare(rewards, response_mask, group_index, group_size)
    st = group_stats(rewards, ids)
    n = st.count
    adv = (rewards - st.mean) * n / (n - 1).clamp(min=1)
    return broadcast_to_tokens(_zero_where(st.constant | (n < 2), adv), response_mask)


@register_advantage_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | None = None,
    *,
    group_size: int | None = None,
    epsilon: float = 1e-6,
    center: bool = False,
) -> Tensor:
    """REINFORCE++ with baseline, exactly:

    1. ``a_i = r_i - mean_g`` (group-mean baseline; 0 for constant groups);
    2. broadcast ``a_i`` to the response tokens and normalise by the std over **all valid
       tokens of the batch** (token-weighted, so longer responses weigh more):
       ``mu = sum_{i,t} m_it a_i / N``, ``sigma = sqrt(sum_{i,t} m_it (a_i - mu)^2 / N)``
       (population std, ``N`` = number of valid tokens), ``A_it = a_i / (sigma + epsilon)``.
       With ``center=True`` the batch mean is removed too, ``A_it = (a_i - mu) / (sigma + epsilon)``
       (full whitening as in OpenRLHF); then constant groups get ``-mu / sigma`` instead of 0,
       which is why it is off by default.

    If all valid tokens carry the same ``a`` (or there are none) the result is all zeros.
    """
    rewards, ids = _prepare(rewards, response_mask, group_index, group_size)
    st = group_stats(rewards, ids)
    tok = broadcast_to_tokens(_zero_where(st.constant, rewards - st.mean), response_mask)
    mask = response_mask.bool()
    valid = tok[mask]
    if valid.numel() == 0 or bool(valid.max() == valid.min()):
        return torch.zeros_like(tok)
    mu = valid.mean()
    sigma = ((valid - mu) ** 2).mean().sqrt()
    shifted = tok - mu if center else tok
    return torch.where(mask, shifted / (sigma + epsilon), torch.zeros_like(tok))


@register_advantage_estimator("maxrl")
def maxrl_advantages(
    rewards: Tensor, response_mask: Tensor, group_index: Tensor | None = None, *, group_size: int | None = None
) -> Tensor:
    """MaxRL ("maximum likelihood RL"): ``A_i = (r_i - mean_g) / mean_g``, 0 where ``mean_g <= 0``.

    Meant for binary / [0, 1] rewards: normalising by the group success rate (not the std)
    makes the update a gradient of log(success probability) rather than of the success
    probability itself, so rarely solved prompts get larger weight. Constant groups give 0.
    """
    rewards, ids = _prepare(rewards, response_mask, group_index, group_size)
    st = group_stats(rewards, ids)
    positive = st.mean > 0
    adv = (rewards - st.mean) / torch.where(positive, st.mean, torch.ones_like(st.mean))
    return broadcast_to_tokens(_zero_where(st.constant | ~positive, adv), response_mask)


def compute_advantages(
    name: str,
    rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | None = None,
    *,
    group_size: int | None = None,
    **kwargs,
) -> Tensor:
    """Look up estimator ``name`` and apply it; returns token-level advantages [B, T]."""
    fn = get_advantage_estimator(name)
    return fn(rewards, response_mask, group_index, group_size=group_size, **kwargs)
