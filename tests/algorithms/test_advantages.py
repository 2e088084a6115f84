"""Advantage estimators vs float64 references written from the formulas with python loops."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_mega.algorithms import compute_advantages, get_advantage_estimator
from skyrl_mega.algorithms.advantages import group_ids

# 12 samples, unsorted non-contiguous group ids:
#   group 7: mixed rewards (4 samples)     group 3: zero variance 0.1 (3 samples)
#   group 9: single sample                 group 1: binary 0/1 (2 samples)
#   group 5: all zero (2 samples)
REWARDS = [0.9, 0.1, 0.2, 0.1, 0.25, 1.0, 0.1, 0.7, 0.0, 0.0, 0.5, 0.0]
GROUPS = [7, 3, 7, 3, 9, 1, 3, 7, 1, 5, 7, 5]
LENGTHS = [4, 2, 0, 5, 3, 1, 5, 5, 2, 3, 4, 1]  # row 2 is all padding
T = 5


def _mask():
    mask = torch.zeros(len(LENGTHS), T, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
    return mask


def _groups(groups):
    out = {}
    for i, g in enumerate(groups):
        out.setdefault(g, []).append(i)
    return out


def _mean(vals):
    return sum(vals) / len(vals)


def _ref_grpo(rewards, groups, norm, eps):
    adv = [0.0] * len(rewards)
    for members in _groups(groups).values():
        vals = [rewards[i] for i in members]
        if max(vals) == min(vals):
            continue
        mean = _mean(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i in members:
            adv[i] = (rewards[i] - mean) / (std + eps) if norm else rewards[i] - mean
    return adv


def _ref_rloo(rewards, groups):
    adv = [0.0] * len(rewards)
    for members in _groups(groups).values():
        if len(members) < 2:
            continue
        for i in members:
            others = [rewards[j] for j in members if j != i]
            adv[i] = rewards[i] - sum(others) / len(others)
    return adv


def _ref_maxrl(rewards, groups):
    adv = [0.0] * len(rewards)
    for members in _groups(groups).values():
        mean = _mean([rewards[i] for i in members])
        if mean > 0:
            for i in members:
                adv[i] = (rewards[i] - mean) / mean
    return adv


def _ref_reinforce_pp(rewards, groups, lengths, eps, center):
    base = [0.0] * len(rewards)
    for members in _groups(groups).values():
        vals = [rewards[i] for i in members]
        if max(vals) == min(vals):
            continue
        mean = _mean(vals)
        for i in members:
            base[i] = rewards[i] - mean
    tokens = [base[i] for i, n in enumerate(lengths) for _ in range(n)]
    mu = _mean(tokens)
    sigma = math.sqrt(sum((a - mu) ** 2 for a in tokens) / len(tokens))
    return [((a - mu) if center else a) / (sigma + eps) for a in base]


def _expand(seq_adv, lengths):
    out = torch.zeros(len(lengths), T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        for t in range(n):
            out[i, t] = seq_adv[i]
    return out


def _run(name, **kw):
    r = torch.tensor(REWARDS, dtype=torch.float64)
    g = torch.tensor(GROUPS)
    return compute_advantages(name, r, _mask(), g, **kw)


def _assert_close(actual, expected):
    assert actual.dtype == torch.float64
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("eps", [1e-6, 0.1])
def test_grpo_with_std(eps):
    _assert_close(_run("grpo", epsilon=eps), _expand(_ref_grpo(REWARDS, GROUPS, True, eps), LENGTHS))


def test_grpo_without_std():
    expected = _expand(_ref_grpo(REWARDS, GROUPS, False, 0.0), LENGTHS)
    _assert_close(_run("grpo", norm_by_std=False), expected)
    _assert_close(_run("grpo_no_std"), expected)


def test_grpo_population_std_option():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    out = compute_advantages("grpo", r, torch.ones(4, 1, dtype=torch.bool), group_size=4, unbiased_std=False, epsilon=0.0)
    # mean 0.25, population std sqrt(0.1875)
    assert out[0, 0].item() == pytest.approx(0.75 / math.sqrt(0.1875), rel=1e-12)


def test_rloo():
    _assert_close(_run("rloo"), _expand(_ref_rloo(REWARDS, GROUPS), LENGTHS))


def test_maxrl():
    _assert_close(_run("maxrl"), _expand(_ref_maxrl(REWARDS, GROUPS), LENGTHS))


def test_maxrl_binary_values():
    # group of 4 with one success: mean 0.25 -> success 3.0, failure -1.0
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    out = compute_advantages("maxrl", r, torch.ones(6, 2, dtype=torch.bool), group_index=torch.tensor([0, 0, 0, 0, 1, 1]))
    assert out[:, 0].tolist() == [3.0, -1.0, -1.0, -1.0, 0.0, 0.0]


@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_reinforce_pp_baseline(center, eps):
    expected = _expand(_ref_reinforce_pp(REWARDS, GROUPS, LENGTHS, eps, center), LENGTHS)
    _assert_close(_run("reinforce_pp_baseline", epsilon=eps, center=center), expected)


@pytest.mark.parametrize("name", ["grpo", "grpo_no_std", "rloo", "reinforce_pp_baseline", "maxrl"])
def test_degenerate_groups_give_exact_zeros(name):
    out = _run(name)
    assert torch.isfinite(out).all()
    mask = _mask()
    assert (out[~mask] == 0).all(), "masked positions must be exactly zero"
    for i, g in enumerate(GROUPS):
        if g in (3, 9, 5):  # zero-variance (mean of 3x0.1 != 0.1 in floats), single-sample, all-zero
            assert (out[i] == 0).all(), (name, i)
    assert (out[2] == 0).all()  # all-pad row


@pytest.mark.parametrize("name", ["grpo", "rloo", "maxrl", "reinforce_pp_baseline"])
def test_all_groups_constant_no_nan(name):
    r = torch.full((6,), 0.7, dtype=torch.float32)
    out = compute_advantages(name, r, torch.ones(6, 3), group_size=3)
    assert out.dtype == torch.float32 and (out == 0).all()


def test_all_pad_batch():
    r = torch.tensor([1.0, 0.0], dtype=torch.float64)
    out = compute_advantages("reinforce_pp_baseline", r, torch.zeros(2, 3, dtype=torch.bool), group_size=2)
    assert (out == 0).all()


def test_pad_row_reward_still_counts_in_group():
    # The all-pad row 1 still contributes its reward to the group baseline.
    r = torch.tensor([1.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([[True, True], [False, False]])
    out = compute_advantages("grpo_no_std", r, mask, group_size=2)
    assert out.tolist() == [[0.5, 0.5], [0.0, 0.0]]


def test_group_size_equals_group_index():
    r = torch.tensor([0.1, 0.9, 0.4, 0.4, 1.0, 0.0], dtype=torch.float64)
    mask = torch.ones(6, 2, dtype=torch.bool)
    for name in ["grpo", "rloo", "maxrl", "reinforce_pp_baseline"]:
        fn = get_advantage_estimator(name)
        a = fn(r, mask, group_size=2)
        b = fn(r, mask, torch.tensor([5, 5, 0, 0, 2, 2]))
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_group_ids_and_errors():
    assert group_ids(5, torch.tensor([9, 2, 9, 4, 2])).tolist() == [2, 0, 2, 1, 0]
    assert group_ids(6, group_size=3).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="exactly one"):
        group_ids(4)
    with pytest.raises(ValueError, match="exactly one"):
        group_ids(4, torch.zeros(4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="does not divide"):
        group_ids(5, group_size=2)
    with pytest.raises(ValueError, match="shape"):
        group_ids(5, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"rewards \[B\]"):
        compute_advantages("grpo", torch.zeros(3), torch.ones(4, 2), group_size=1)
