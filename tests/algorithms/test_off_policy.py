"""Off-policy corrections vs float64 references written with python floats."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_mega.algorithms import get_off_policy_correction
from skyrl_mega.algorithms.off_policy import masked_is, sequence_tis, token_tis

from .helpers import randn

LENGTHS = [6, 3, 0, 6, 2, 5]


def _data(scale=0.4, seed=5):
    n_rows, n_cols = len(LENGTHS), 6
    mask = torch.zeros(n_rows, n_cols, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
    rollout = -randn(n_rows, n_cols, seed=seed).abs()
    old = rollout + randn(n_rows, n_cols, seed=seed + 1, scale=scale)
    return old, rollout, mask


def _token_ratios(old, rollout, mask, i):
    return [math.exp(old[i, t].item() - rollout[i, t].item()) for t in range(old.shape[1]) if mask[i, t]]


@pytest.mark.parametrize("cap", [1.2, 2.0, 10.0])
def test_token_tis(cap):
    old, rollout, mask = _data()
    out = token_tis(old, rollout, mask, cap=cap)
    ref = torch.zeros_like(old)
    ref_trunc = torch.zeros_like(old)
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            if mask[i, t]:
                r = math.exp(old[i, t].item() - rollout[i, t].item())
                ref[i, t] = min(r, cap)
                ref_trunc[i, t] = float(r > cap)
    torch.testing.assert_close(out.weights, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.metrics["is_truncated"], ref_trunc, rtol=0, atol=0)
    assert torch.equal(out.mask, mask)
    if cap == 1.2:
        assert ref_trunc.sum() > 0


@pytest.mark.parametrize("cap", [0.8, 2.0, 1e6])
def test_sequence_tis(cap):
    old, rollout, mask = _data()
    out = sequence_tis(old, rollout, mask, cap=cap)
    ref = torch.zeros_like(old)
    for i in range(old.shape[0]):
        prod = 1.0
        for r in _token_ratios(old, rollout, mask, i):
            prod *= r
        for t in range(LENGTHS[i]):
            ref[i, t] = min(prod, cap)
    torch.testing.assert_close(out.weights, ref, rtol=1e-12, atol=0)
    assert torch.equal(out.mask, mask)


def test_sequence_tis_huge_ratio_is_finite():
    # product of 6 ratios of e^150 overflows float64 in a naive product; the weight must be exactly cap
    old, rollout, mask = _data()
    old = rollout + 150.0
    out = sequence_tis(old, rollout, mask, cap=3.0)
    prod = 1.0
    for r in _token_ratios(old, rollout, mask, 0):
        prod *= r
    assert prod == math.inf
    assert torch.isfinite(out.weights).all()
    assert (out.weights[mask] == 3.0).all() and (out.metrics["is_truncated"][mask] == 1).all()


@pytest.mark.parametrize("seq_ratio", ["geometric", "product"])
@pytest.mark.parametrize("use_weight", [True, False])
def test_masked_is(seq_ratio, use_weight):
    old, rollout, mask = _data(scale=0.5)
    low, high = (0.8, 1.25) if seq_ratio == "geometric" else (0.5, 2.0)
    out = masked_is(old, rollout, mask, low=low, high=high, seq_ratio=seq_ratio, use_weight=use_weight)
    ref_w = torch.zeros_like(old)
    ref_mask = torch.zeros_like(mask)
    kept = []
    for i in range(old.shape[0]):
        ratios = _token_ratios(old, rollout, mask, i)
        if seq_ratio == "product":
            rho = math.prod(ratios)
        else:
            rho = math.prod(ratios) ** (1.0 / len(ratios)) if ratios else 1.0
        keep = low <= rho <= high
        kept.append(keep)
        for t in range(LENGTHS[i]):
            if keep:
                ref_w[i, t] = rho if use_weight else 1.0
                ref_mask[i, t] = True
    torch.testing.assert_close(out.weights, ref_w, rtol=1e-12, atol=0)
    assert torch.equal(out.mask, ref_mask)
    rejected = torch.zeros_like(old)
    for i, keep in enumerate(kept):
        if not keep:
            rejected[i, : LENGTHS[i]] = 1.0
    torch.testing.assert_close(out.metrics["is_rejected"], rejected, rtol=0, atol=0)
    # data covers both kept and dropped non-empty sequences
    nonempty = [k for k, n in zip(kept, LENGTHS) if n]
    assert any(nonempty) and not all(nonempty)


def test_masked_is_threshold_both_sides():
    # 2-token sequences with geometric ratios 0.5, 0.9, 1.0, 1.5, 3.0 and [low, high] = [0.8, 2.0]
    rhos = [0.5, 0.9, 1.0, 1.5, 3.0]
    rollout = torch.full((5, 2), -1.0, dtype=torch.float64)
    old = rollout + torch.log(torch.tensor(rhos, dtype=torch.float64))[:, None]
    mask = torch.ones(5, 2, dtype=torch.bool)
    out = masked_is(old, rollout, mask, low=0.8, high=2.0)
    assert out.mask[:, 0].tolist() == [False, True, True, True, False]
    torch.testing.assert_close(out.weights[:, 1], torch.tensor([0.0, 0.9, 1.0, 1.5, 0.0], dtype=torch.float64))
    prod = masked_is(old, rollout, mask, low=0.8, high=2.0, seq_ratio="product")  # 0.25 .81 1 2.25 9
    assert prod.mask[:, 0].tolist() == [False, True, True, False, False]
    with pytest.raises(ValueError, match="seq_ratio"):
        masked_is(old, rollout, mask, seq_ratio="mean")
    with pytest.raises(ValueError, match="low"):
        masked_is(old, rollout, mask, low=2.0, high=1.0)


@pytest.mark.parametrize("name", ["tis", "seq_tis", "mis"])
def test_weights_are_detached_and_pads_zero(name):
    old, rollout, mask = _data()
    old = old.clone().requires_grad_()
    out = get_off_policy_correction(name)(old, rollout, mask)
    assert not out.weights.requires_grad
    assert (out.weights[~mask] == 0).all()
    assert (out.weights[2] == 0).all() and not out.mask[2].any()  # all-pad row
    for v in out.metrics.values():
        assert v.shape == mask.shape and (v[~mask] == 0).all() and not v.requires_grad


def test_select_slices_everything():
    old, rollout, mask = _data()
    out = masked_is(old, rollout, mask)
    part = out.select((slice(1, 4), slice(2, 5)))
    assert torch.equal(part.weights, out.weights[1:4, 2:5])
    assert torch.equal(part.mask, out.mask[1:4, 2:5])
    assert set(part.metrics) == set(out.metrics)
    assert torch.equal(part.metrics["is_rejected"], out.metrics["is_rejected"][1:4, 2:5])
