"""KL estimators and entropy vs float64 references (python math / numpy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from skyrl_mega.algorithms import entropy_from_logits, get_kl_estimator, kl_penalty

from .helpers import randn

REF_KL = {
    "k1": lambda lp, ref: lp - ref,
    "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "k3": lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1.0,
}


def _pairs():
    lp = -randn(4, 9, seed=21).abs()
    ref = lp + randn(4, 9, seed=22, scale=0.7)
    ref[0, 0] = lp[0, 0]  # identical policies -> every estimator is 0
    ref[0, 1] = lp[0, 1] + 1e-7  # tiny gap: expm1 keeps k3 accurate
    return lp, ref


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_kl_estimators_match_formula(name):
    lp, ref = _pairs()
    out = kl_penalty(lp, ref, name)
    expected = torch.tensor([[REF_KL[name](a, b) for a, b in zip(r1, r2)] for r1, r2 in zip(lp.tolist(), ref.tolist())], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-15)
    assert out[0, 0] == 0
    if name in ("k2", "k3"):
        assert (out >= 0).all()


def test_k3_small_gap_is_accurate_in_float32():
    lp = torch.zeros(1)
    ref = torch.full((1,), 1e-3)
    k3 = kl_penalty(lp, ref, "k3")  # exact: e^d - d - 1 ~= d^2/2 + d^3/6
    assert k3.item() == pytest.approx(0.5e-6 + 1e-9 / 6, rel=1e-4)


def test_kl_gradients():
    lp, ref = _pairs()
    lp = lp.clone().requires_grad_()
    for name, dref in {
        "k1": lambda a, b: 1.0,
        "k2": lambda a, b: a - b,
        "k3": lambda a, b: 1.0 - math.exp(b - a),
    }.items():
        (g,) = torch.autograd.grad(kl_penalty(lp, ref, name).sum(), lp)
        expected = torch.tensor([[dref(a, b) for a, b in zip(r1, r2)] for r1, r2 in zip(lp.tolist(), ref.tolist())], dtype=torch.float64)
        torch.testing.assert_close(g, expected, rtol=1e-10, atol=1e-14)


def test_kl_clamp_and_aliases():
    lp, ref = _pairs()
    raw = kl_penalty(lp, ref, "k1")
    clamped = kl_penalty(lp, ref, "k1", clamp=0.3)
    torch.testing.assert_close(clamped, raw.clamp(-0.3, 0.3))
    assert (raw.abs() > 0.3).any()
    assert get_kl_estimator("low_var_kl") is get_kl_estimator("k3")
    assert get_kl_estimator("mse") is get_kl_estimator("k2")
    assert get_kl_estimator("kl") is get_kl_estimator("k1")
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(lp, ref, "k4")


def test_k3_huge_gap_stays_finite():
    lp = torch.tensor([-200.0, -1.0], requires_grad=True)
    ref = torch.tensor([-0.1, -1.5])
    k3 = kl_penalty(lp, ref, "k3", clamp=10.0)
    k3.sum().backward()
    assert torch.isfinite(k3).all() and torch.isfinite(lp.grad).all()
    assert k3[0].item() == 10.0


def _ref_entropy(logits: np.ndarray) -> np.ndarray:
    flat = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    out = []
    for row in flat:
        m = np.max(row)
        w = np.exp(row - m)
        p = w / w.sum()
        out.append(-sum(pi * math.log(pi) for pi in p if pi > 0))
    return np.array(out).reshape(logits.shape[:-1])


@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4])
def test_entropy_matches_numpy(scale):
    logits = randn(3, 5, 11, seed=31, scale=scale)
    out = entropy_from_logits(logits)
    assert out.shape == (3, 5)
    np.testing.assert_allclose(out.numpy(), _ref_entropy(logits.numpy()), rtol=1e-10, atol=1e-12)


def test_entropy_uniform_and_one_hot():
    assert entropy_from_logits(torch.zeros(7, dtype=torch.float64)).item() == pytest.approx(math.log(7), rel=1e-14)
    one_hot = torch.tensor([0.0, -torch.inf, -torch.inf])
    assert entropy_from_logits(one_hot).item() == 0.0


def test_entropy_with_banned_tokens_no_nan_value_or_grad():
    logits = randn(4, 6, seed=32).requires_grad_()
    banned = torch.zeros(4, 6, dtype=torch.bool)
    banned[:, 0] = True
    banned[1, 1:4] = True
    masked_logits = logits.masked_fill(banned, -torch.inf)
    h = entropy_from_logits(masked_logits)
    h.sum().backward()
    assert torch.isfinite(h).all() and torch.isfinite(logits.grad).all()
    assert (logits.grad[banned] == 0).all()
    kept = logits.detach()[1, 4:]
    np.testing.assert_allclose(h[1].item(), _ref_entropy(kept.numpy()), rtol=1e-12)


def test_entropy_gradient_matches_formula():
    # dH/dz_k = -p_k (log p_k + H)
    logits = randn(2, 5, seed=33).requires_grad_()
    h = entropy_from_logits(logits)
    (g,) = torch.autograd.grad(h.sum(), logits)
    for i in range(2):
        z = logits[i].tolist()
        m = max(z)
        w = [math.exp(v - m) for v in z]
        p = [v / sum(w) for v in w]
        H = -sum(pi * math.log(pi) for pi in p)
        for k in range(5):
            assert g[i, k].item() == pytest.approx(-p[k] * (math.log(p[k]) + H), rel=1e-10, abs=1e-14)


def test_entropy_low_precision_input():
    logits = randn(3, 50, seed=34, scale=5.0)
    out = entropy_from_logits(logits.to(torch.bfloat16))
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), _ref_entropy(logits.to(torch.bfloat16).double().numpy()), rtol=1e-5, atol=1e-5)
