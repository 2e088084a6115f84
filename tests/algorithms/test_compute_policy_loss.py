"""compute_policy_loss end to end: value vs a loop reference, split invariance (micro-batch,
data-parallel, context-parallel) of loss, gradients and metric sums, and padding hygiene."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_mega.algorithms import (
    REDUCTION_MODES,
    compute_advantages,
    compute_loss_normalizers,
    compute_policy_loss,
    entropy_from_logits,
    get_off_policy_correction,
)

from .helpers import SPLITS, B, T, make_mask, randn, trimmed_columns

V = 5
MAX_LEN = 9


def _batch():
    """Float64 batch whose logprobs and entropy both depend on one logits leaf."""
    mask = make_mask()
    logits = randn(B, T, V, seed=51).requires_grad_()
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(52))
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    entropy = entropy_from_logits(logits)
    old = logprobs.detach() + randn(B, T, seed=53, scale=0.3)
    rollout = old + randn(B, T, seed=54, scale=0.3)
    ref = old + randn(B, T, seed=55, scale=0.5)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 1.0, 0.3, 0.9], dtype=torch.float64)
    adv = compute_advantages("grpo", rewards, mask, group_size=2)
    return dict(logits=logits, logprobs=logprobs, old=old, rollout=rollout, ref=ref, adv=adv, entropy=entropy, mask=mask)


def _ref_loss(d, reduction, tis_cap, kl_coef, ent_coef, eps_low=0.2, eps_high=0.28, c=3.0):
    """PPO(dual clip) * token-TIS + kl_coef * k3 - ent_coef * entropy, reduced, from the formulas."""
    lp, old, roll, ref = (d[k].tolist() for k in ("logprobs", "old", "rollout", "ref"))
    adv, ent, mask = d["adv"].tolist(), d["entropy"].tolist(), d["mask"].tolist()
    rows = []
    for i in range(B):
        row = []
        for t in range(T):
            if not mask[i][t]:
                continue
            r = math.exp(lp[i][t] - old[i][t])
            a = adv[i][t]
            pg = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
            if a < 0:
                pg = min(pg, -a * c)
            w = min(math.exp(old[i][t] - roll[i][t]), tis_cap)
            dlt = ref[i][t] - lp[i][t]
            k3 = math.exp(dlt) - dlt - 1
            row.append(pg * w + kl_coef * k3 - ent_coef * ent[i][t])
        rows.append(row)
    nonempty = [r for r in rows if r]
    if reduction == "token_mean":
        return sum(map(sum, rows)) / sum(map(len, rows))
    if reduction == "sequence_mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    return sum(sum(r) / MAX_LEN for r in nonempty) / len(nonempty)


@pytest.mark.parametrize("reduction", REDUCTION_MODES)
def test_value_matches_reference(reduction):
    d = _batch()
    norms = compute_loss_normalizers(d["mask"], MAX_LEN)
    loss, metrics = compute_policy_loss(
        d["logprobs"], d["old"], d["adv"], d["mask"],
        policy_loss="ppo", policy_loss_kwargs=dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0),
        reduction=reduction, **norms.for_rows(),
        off_policy="tis", off_policy_kwargs=dict(cap=1.5), rollout_logprobs=d["rollout"],
        ref_logprobs=d["ref"], kl_coef=0.05, kl_estimator="k3",
        entropy=d["entropy"], entropy_coef=0.01,
    )
    expected = _ref_loss(d, reduction, tis_cap=1.5, kl_coef=0.05, ent_coef=0.01)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    parts = metrics["pg_loss"] + 0.05 * metrics["kl_loss"] - 0.01 * metrics["entropy_loss"]
    assert parts.item() == pytest.approx(loss.item(), rel=1e-12)
    assert metrics["loss"].item() == loss.item()
    assert metrics["num_tokens"].item() == d["mask"].sum().item()
    # KL-only and entropy-only parts vs the formulas
    only_kl = _ref_loss(d, reduction, tis_cap=1.5, kl_coef=1.0, ent_coef=0.0) - _ref_loss(d, reduction, 1.5, 0.0, 0.0)
    assert metrics["kl_loss"].item() == pytest.approx(only_kl, rel=1e-10)


def test_metric_token_sums():
    d = _batch()
    norms = compute_loss_normalizers(d["mask"])
    _, metrics = compute_policy_loss(
        d["logprobs"], d["old"], d["adv"], d["mask"], policy_loss_kwargs=dict(eps_low=0.1),
        off_policy="tis", rollout_logprobs=d["rollout"], **norms.for_rows(),
    )
    mask, lp, old, adv = d["mask"], d["logprobs"].detach(), d["old"], d["adv"]
    clipped = 0
    for i in range(B):
        for t in range(T):
            r = math.exp(lp[i, t].item() - old[i, t].item())
            a = adv[i, t].item()
            clipped += bool(mask[i, t]) and ((a > 0 and r > 1.1) or (a < 0 and r < 0.9))
    assert metrics["token_sum/pg/clipped"].item() == clipped > 0
    w = torch.where(mask, (old - d["rollout"]).exp().clamp(max=2.0), 0.0).sum()
    assert metrics["token_sum/off_policy/is_weight"].item() == pytest.approx(w.item(), rel=1e-12)
    assert all(not v.requires_grad for v in metrics.values())


CONFIGS = {
    "ppo+tis+kl+ent": dict(
        policy_loss="ppo", policy_loss_kwargs=dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0),
        off_policy="tis", off_policy_kwargs=dict(cap=1.5), kl_coef=0.05, entropy_coef=0.01,
    ),
    "gspo+seq_tis+k2": dict(
        policy_loss="gspo", policy_loss_kwargs=dict(eps_low=0.05, eps_high=0.05),
        off_policy="seq_tis", kl_coef=0.1, kl_estimator="k2",
    ),
    "cispo+mis+ent": dict(
        policy_loss="cispo", off_policy="mis", off_policy_kwargs=dict(low=0.85, high=1.15), entropy_coef=0.02,
    ),
}


def _call(d, rows, cols, norms, config, off_policy_override=None, **extra):
    take = lambda x: x[rows][:, cols]  # noqa: E731
    kwargs = dict(config)
    if off_policy_override is not None:
        kwargs["off_policy"] = off_policy_override
    return compute_policy_loss(
        take(d["logprobs"]), take(d["old"]), take(d["adv"]), take(d["mask"]),
        rollout_logprobs=take(d["rollout"]), ref_logprobs=take(d["ref"]), entropy=take(d["entropy"]),
        reduction=extra.pop("reduction"), **norms.for_rows(rows), **kwargs, **extra,
    )


def _full(d, config, reduction, norms):
    loss, metrics = _call(d, list(range(B)), slice(None), norms, config, reduction=reduction)
    (grad,) = torch.autograd.grad(loss, d["logits"], retain_graph=True)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("reduction", REDUCTION_MODES)
def test_microbatch_and_dp_splits_match_full_batch(config, reduction):
    d = _batch()
    norms = compute_loss_normalizers(d["mask"], MAX_LEN)
    full_loss, full_grad, full_metrics = _full(d, CONFIGS[config], reduction, norms)
    assert full_grad.abs().sum() > 0
    if config == "cispo+mis+ent":
        assert 0 < full_metrics["num_train_tokens"] < full_metrics["num_tokens"]  # MIS really drops some
    for split, pieces in SPLITS.items():
        grad = torch.zeros_like(full_grad)
        sums = {k: torch.zeros_like(v) for k, v in full_metrics.items()}
        for rows in pieces:
            loss, metrics = _call(d, rows, trimmed_columns(d["mask"], rows), norms, CONFIGS[config], reduction=reduction)
            (g,) = torch.autograd.grad(loss, d["logits"], retain_graph=True)
            grad += g
            for k, v in metrics.items():
                sums[k] = sums[k] + v
        torch.testing.assert_close(grad, full_grad, rtol=0, atol=1e-12, msg=split)
        assert set(sums) == set(full_metrics)
        for k, v in full_metrics.items():
            torch.testing.assert_close(sums[k].double(), v.double(), rtol=0, atol=1e-12, msg=f"{split}: {k}")


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("reduction", REDUCTION_MODES)
def test_context_parallel_shards_match_full_batch(config, reduction):
    """Columns split over 2 CP ranks (plus 4 micro-batches of 2 rows). Sequence-level quantities
    come from the full sequences: global seq counts, GSPO's seq_log_ratio, precomputed correction."""
    d = _batch()
    cfg = dict(CONFIGS[config])
    norms = compute_loss_normalizers(d["mask"], MAX_LEN)
    full_loss, full_grad, _ = _full(d, cfg, reduction, norms)
    correction = get_off_policy_correction(cfg["off_policy"])(
        d["old"], d["rollout"], d["mask"], **cfg.get("off_policy_kwargs", {})
    )
    if cfg["policy_loss"] == "gspo":
        lr = torch.where(d["mask"], d["logprobs"].detach() - d["old"], 0.0)
        seq_lr = lr.sum(-1) / d["mask"].sum(-1).clamp(min=1)
    grad = torch.zeros_like(full_grad)
    total = torch.zeros((), dtype=torch.float64)
    for rows in SPLITS["4x2"]:
        for cols in (slice(0, 3), slice(3, T)):
            if cfg["policy_loss"] == "gspo":
                cfg["policy_loss_kwargs"] = dict(CONFIGS[config]["policy_loss_kwargs"], seq_log_ratio=seq_lr[rows])
            loss, _ = _call(
                d, rows, cols, norms, cfg, off_policy_override=correction.select((rows, cols)), reduction=reduction
            )
            (g,) = torch.autograd.grad(loss, d["logits"], retain_graph=True)
            grad += g
            total += loss.detach()
    torch.testing.assert_close(total, full_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, full_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_garbage_at_padding_does_not_leak(config):
    d = _batch()
    norms = compute_loss_normalizers(d["mask"], MAX_LEN)
    clean_loss, clean_grad, clean_metrics = _full(d, CONFIGS[config], "sequence_mean", norms)
    pad = ~d["mask"]
    dirty = dict(d)
    for key, junk in (("old", torch.nan), ("rollout", -torch.inf), ("ref", torch.nan), ("adv", torch.nan), ("entropy", torch.inf)):
        dirty[key] = d[key].masked_fill(pad, junk)
    dirty["logprobs"] = d["logprobs"].masked_fill(pad, torch.nan)
    loss, grad, metrics = _full(dirty, CONFIGS[config], "sequence_mean", norms)
    assert loss.item() == clean_loss.item()
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=0)
    for k, v in metrics.items():
        assert torch.equal(v, clean_metrics[k]), k


def test_callable_policy_loss_and_errors():
    d = _batch()
    norms = compute_loss_normalizers(d["mask"]).for_rows()
    args = (d["logprobs"], d["old"], d["adv"], d["mask"])

    def plain_pg(logprobs, old_logprobs, advantages, mask):
        return torch.where(mask, -advantages * logprobs, 0.0), {}

    loss, _ = compute_policy_loss(*args, policy_loss=plain_pg, **norms)
    expected = -(torch.where(d["mask"], d["adv"] * d["logprobs"], 0.0)).sum() / d["mask"].sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        compute_policy_loss(*args, off_policy="tis", **norms)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_policy_loss(*args, kl_coef=0.1, **norms)
    with pytest.raises(ValueError, match="entropy"):
        compute_policy_loss(*args, entropy_coef=0.1, **norms)
    with pytest.raises(ValueError, match="choices: cispo, gspo, ppo"):
        compute_policy_loss(*args, policy_loss="ppo2", **norms)
