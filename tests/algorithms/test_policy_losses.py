"""Policy losses vs float64 per-token references (python floats), values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_mega.algorithms import get_policy_loss, reduce_loss
from skyrl_mega.algorithms.policy_losses import cispo_loss, gspo_loss, ppo_clip_loss

from .helpers import randn

# log-ratios spanning: far below / just below / inside / exactly 1 / inside / inside only for
# eps_high=0.28 / above / far above (beyond dual-clip c=3).
LOG_RATIOS = [-1.0, -0.3, -0.15, 0.0, 0.1, 0.24, 0.5, 1.5]
ADV = [1.3, -0.7, 0.0, -2.0, 0.4]  # per row; row 4 is all padding
LENGTHS = [8, 6, 8, 8, 0]


def _ppo_data():
    n_rows, n_cols = len(ADV), len(LOG_RATIOS)
    old = -randn(n_rows, n_cols, seed=1).abs() - 0.1
    shift = torch.tensor([[LOG_RATIOS[(t + i) % n_cols] for t in range(n_cols)] for i in range(n_rows)], dtype=torch.float64)
    logprobs = (old + shift).requires_grad_()
    adv = torch.tensor(ADV, dtype=torch.float64)[:, None].expand(n_rows, n_cols).clone()
    adv[0, 3] = -0.5  # token-varying advantages are allowed for token-level losses
    mask = torch.zeros(n_rows, n_cols, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
    return logprobs, old, adv, mask


def _ref_ppo(lp, old, adv, mask, eps_low, eps_high, c):
    """Returns per-token (loss, dloss/dlogprob, clipped, dual_clipped) as nested lists."""
    n_rows, n_cols = len(lp), len(lp[0])
    out = {k: [[0.0] * n_cols for _ in range(n_rows)] for k in ("loss", "grad", "clipped", "dual")}
    for i in range(n_rows):
        for t in range(n_cols):
            if not mask[i][t]:
                continue
            a = adv[i][t]
            r = math.exp(lp[i][t] - old[i][t])
            unclipped = -a * r
            clipped = -a * min(max(r, 1 - eps_low), 1 + eps_high)
            if clipped > unclipped:
                loss, grad, was_clipped = clipped, 0.0, 1.0
            else:
                loss, grad, was_clipped = unclipped, -a * r, 0.0
            dual = 0.0
            if c is not None and a < 0 and loss > -a * c:
                loss, grad, dual = -a * c, 0.0, 1.0
            out["loss"][i][t], out["grad"][i][t] = loss, grad
            out["clipped"][i][t], out["dual"][i][t] = was_clipped, dual
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


@pytest.mark.parametrize(
    "eps_low,eps_high,c",
    [(0.2, None, None), (0.2, 0.28, None), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5)],
)
def test_ppo_matches_reference(eps_low, eps_high, c):
    lp, old, adv, mask = _ppo_data()
    loss, metrics = ppo_clip_loss(lp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, clip_ratio_c=c)
    ref = _ref_ppo(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), eps_low, eps_high if eps_high is not None else eps_low, c)
    torch.testing.assert_close(loss, ref["loss"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(metrics["clipped"], ref["clipped"], rtol=0, atol=0)
    torch.testing.assert_close(metrics["dual_clipped"], ref["dual"], rtol=0, atol=0)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(grad, ref["grad"], rtol=1e-12, atol=1e-12)
    # the data really exercises both clip sides and, with c, the dual clip
    assert ref["clipped"].sum() >= 4
    if c == 3.0:
        assert ref["dual"].sum() >= 1


def test_ppo_asymmetric_range_and_dual_clip_cases():
    lp = torch.log(torch.tensor([[1.25, 1.25, 0.75, 4.0, 4.0, 2.0]], dtype=torch.float64))
    old = torch.zeros_like(lp)
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones_like(lp, dtype=torch.bool)
    sym, m_sym = ppo_clip_loss(lp, old, adv, mask, eps_low=0.2)
    asym, m_asym = ppo_clip_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    assert m_sym["clipped"][0].tolist() == [1, 0, 1, 0, 1, 0]
    assert m_asym["clipped"][0].tolist() == [0, 0, 1, 0, 1, 0]
    assert sym[0, 0].item() == pytest.approx(-1.2) and asym[0, 0].item() == pytest.approx(-1.25)
    # A<0, ratio 4 > c=3: loss capped at -A*c = 3 (it would be 4 without dual clip); ratio 2 < c untouched
    assert asym[0, 3].item() == pytest.approx(3.0) and sym[0, 3].item() == pytest.approx(4.0)
    assert m_asym["dual_clipped"][0].tolist() == [0, 0, 0, 1, 0, 0]
    # A>0 with ratio 4 is never dual-clipped
    assert asym[0, 4].item() == pytest.approx(-1.28)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(lp, old, adv, mask, clip_ratio_c=1.0)


def test_ppo_metrics_ratio_and_kl():
    lp, old, adv, mask = _ppo_data()
    _, metrics = ppo_clip_loss(lp, old, adv, mask)
    diff = (lp - old).detach()
    torch.testing.assert_close(metrics["ratio"], torch.where(mask, diff.exp(), 0.0), rtol=1e-12, atol=0)
    torch.testing.assert_close(metrics["approx_kl"], torch.where(mask, -diff, 0.0), rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_garbage_at_padding_never_leaks(name):
    lp, old, adv, mask = _ppo_data()
    fn = get_policy_loss(name)
    clean_loss, clean_metrics = fn(lp, old, adv, mask)
    (clean_grad,) = torch.autograd.grad(clean_loss.sum(), lp)
    dirty_lp = torch.where(mask, lp.detach(), torch.nan).requires_grad_()
    dirty_old = torch.where(mask, old, torch.inf)
    dirty_adv = torch.where(mask, adv, torch.nan)
    loss, metrics = fn(dirty_lp, dirty_old, dirty_adv, mask)
    (grad,) = torch.autograd.grad(loss.sum(), dirty_lp)
    torch.testing.assert_close(loss, clean_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=0)
    assert (loss[~mask] == 0).all() and (grad[~mask] == 0).all() and (grad[4] == 0).all()
    for k, v in metrics.items():
        torch.testing.assert_close(v, clean_metrics[k], rtol=0, atol=0)


# ---------------------------------------------------------------- GSPO

GSPO_MEANS = [1e-4, 1e-3, -1e-3, -1e-3, 5e-5]  # seq mean log-ratio: inside, above, below, below, inside
GSPO_ADV = [0.8, 1.1, -0.6, 0.9, 0.0]
GSPO_LENGTHS = [5, 3, 6, 1, 0]


def _gspo_data(seed=3):
    n_rows, n_cols = len(GSPO_MEANS), 6
    mask = torch.zeros(n_rows, n_cols, dtype=torch.bool)
    for i, n in enumerate(GSPO_LENGTHS):
        mask[i, :n] = True
    noise = randn(n_rows, n_cols, seed=seed, scale=0.05)
    lr = torch.zeros(n_rows, n_cols, dtype=torch.float64)
    for i, n in enumerate(GSPO_LENGTHS):
        if n:
            row = noise[i, :n] - noise[i, :n].mean() + GSPO_MEANS[i]
            lr[i, :n] = row
    old = -randn(n_rows, n_cols, seed=seed + 1).abs()
    lp = (old + lr).requires_grad_()
    adv = torch.tensor(GSPO_ADV, dtype=torch.float64)[:, None].expand(n_rows, n_cols).clone()
    return lp, old, adv, mask


def _ref_gspo(lp, old, adv, mask, weights, eps_low, eps_high):
    """Per-token loss and the gradient of sum_{i,t} weights_it * loss_it, from the formula."""
    n_rows, n_cols = len(lp), len(lp[0])
    loss = [[0.0] * n_cols for _ in range(n_rows)]
    grad = [[0.0] * n_cols for _ in range(n_rows)]
    clipped = [[0.0] * n_cols for _ in range(n_rows)]
    for i in range(n_rows):
        valid = [t for t in range(n_cols) if mask[i][t]]
        if not valid:
            continue
        s = math.exp(sum(lp[i][t] - old[i][t] for t in valid) / len(valid))
        dloss_ds = {}
        for t in valid:
            a = adv[i][t]
            unclipped, clip_val = -a * s, -a * min(max(s, 1 - eps_low), 1 + eps_high)
            if clip_val > unclipped:
                loss[i][t], dloss_ds[t], clipped[i][t] = clip_val, 0.0, 1.0
            else:
                loss[i][t], dloss_ds[t] = unclipped, -a
        # ds/dlp_t' = s / n for every valid t' (the gradient flows through the sequence ratio)
        total = sum(weights[i][t] * dloss_ds[t] for t in valid)
        for t in valid:
            grad[i][t] = total * s / len(valid)
    as_t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return as_t(loss), as_t(grad), as_t(clipped)


@pytest.mark.parametrize("eps_low,eps_high", [(3e-4, 4e-4), (2e-3, 2e-3)])
def test_gspo_matches_reference_and_gradient_through_sequence_ratio(eps_low, eps_high):
    lp, old, adv, mask = _gspo_data()
    weights = randn(*lp.shape, seed=11).abs() + 0.1  # non-uniform token weights
    loss, metrics = gspo_loss(lp, old, adv, mask, eps_low=eps_low, eps_high=eps_high)
    ref_loss, ref_grad, ref_clipped = _ref_gspo(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), weights.tolist(), eps_low, eps_high)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(metrics["clipped"], ref_clipped, rtol=0, atol=0)
    (grad,) = torch.autograd.grad((loss * weights).sum(), lp)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    if eps_low == 3e-4:
        assert metrics["clipped"][1].sum() == 3 and metrics["clipped"][2].sum() == 6  # above / below range
        assert metrics["clipped"][0].sum() == 0 and metrics["clipped"][3].sum() == 0


def test_gspo_gradient_reaches_every_token_of_the_sequence():
    lp, old, adv, mask = _gspo_data()
    loss, _ = gspo_loss(lp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss[0, 0], lp)  # loss of ONE token of the unclipped row 0
    assert (grad[0, :5] != 0).all() and (grad[0, 5:] == 0).all() and (grad[1:] == 0).all()
    # token-level PPO would only touch that one token
    ppo, _ = ppo_clip_loss(lp, old, adv, mask)
    (ppo_grad,) = torch.autograd.grad(ppo[0, 0], lp)
    assert (ppo_grad != 0).sum() == 1


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"])
def test_gspo_token_form_with_given_seq_log_ratio_matches(mode):
    lp, old, adv, mask = _gspo_data()
    norms = dict(global_num_tokens=mask.sum(), global_num_sequences=(mask.sum(-1) > 0).sum(), max_len=6)
    plain, plain_metrics = gspo_loss(lp, old, adv, mask)
    (plain_grad,) = torch.autograd.grad(reduce_loss(plain, mask, mode, **norms), lp)
    lr = torch.where(mask, lp - old, 0.0).detach()
    seq_lr = lr.sum(-1) / mask.sum(-1).clamp(min=1)
    token_form, tok_metrics = gspo_loss(lp, old, adv, mask, seq_log_ratio=seq_lr)
    torch.testing.assert_close(token_form, plain, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(tok_metrics["clipped"], plain_metrics["clipped"], rtol=0, atol=0)
    (grad,) = torch.autograd.grad(reduce_loss(token_form, mask, mode, **norms), lp)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- CISPO


@pytest.mark.parametrize("eps_low,eps_high", [(None, 0.2), (0.1, 0.28), (None, None)])
def test_cispo_matches_reference(eps_low, eps_high):
    lp, old, adv, mask = _ppo_data()
    loss, metrics = cispo_loss(lp, old, adv, mask, eps_low=eps_low, eps_high=eps_high)
    n_rows, n_cols = lp.shape
    ref_loss = torch.zeros(n_rows, n_cols, dtype=torch.float64)
    ref_grad = torch.zeros_like(ref_loss)
    ref_clipped = torch.zeros_like(ref_loss)
    for i in range(n_rows):
        for t in range(n_cols):
            if not mask[i, t]:
                continue
            r = math.exp(lp[i, t].item() - old[i, t].item())
            w = r
            if eps_low is not None:
                w = max(w, 1 - eps_low)
            if eps_high is not None:
                w = min(w, 1 + eps_high)
            a = adv[i, t].item()
            ref_loss[i, t] = -w * a * lp[i, t].item()
            ref_grad[i, t] = -w * a  # the IS weight is a constant: no d(w)/d(logprob) term
            ref_clipped[i, t] = float(w != r)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(metrics["clipped"], ref_clipped, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    if eps_high is not None:
        assert ref_clipped.sum() > 0  # clipped tokens keep a (capped) gradient, unlike PPO
        assert (grad[(ref_clipped == 1) & (adv != 0)] != 0).all()


def test_cispo_is_weight_carries_no_gradient():
    lp, old, adv, mask = _ppo_data()
    loss, metrics = cispo_loss(lp, old, adv, mask)
    assert not metrics["is_weight"].requires_grad
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    # If the weight r = exp(lp - old) were differentiated, the gradient would be
    # -A (r + r * lp) on unclipped tokens; it must be exactly -A * w.
    w = metrics["is_weight"]
    torch.testing.assert_close(grad, -w * torch.where(mask, adv, 0.0), rtol=1e-12, atol=1e-12)
    with_grad_weight = -(torch.where(mask, adv, 0.0)) * (w + w * lp.detach())
    unclipped = (metrics["clipped"] == 0) & mask & (adv != 0)
    assert not torch.allclose(grad[unclipped], with_grad_weight[unclipped])
