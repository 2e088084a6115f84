"""Loss reductions: values vs loop references, and split invariance of the gradient."""

from __future__ import annotations

import pytest
import torch

from skyrl_mega.algorithms import REDUCTION_MODES, compute_loss_normalizers, reduce_loss

from .helpers import LENGTHS, SPLITS, B, T, make_mask, randn, trimmed_columns

MAX_LEN = 10  # Dr.GRPO constant, deliberately larger than T


def _per_token_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Some nonlinear per-token function of logprobs with per-token coefficients."""
    c = randn(B, T, seed=41)
    return c * torch.sin(logprobs) + 0.5 * logprobs**2


def _ref_reduce(loss: list[list[float]], mask: list[list[bool]], mode: str) -> float:
    """Straight from the definitions, over the whole global batch."""
    rows = [[l for l, m in zip(lr, mr) if m] for lr, mr in zip(loss, mask)]
    nonempty = [r for r in rows if r]
    if mode == "token_mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "sequence_mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    if mode == "seq_mean_token_sum_norm":
        return sum(sum(r) / MAX_LEN for r in nonempty) / len(nonempty)
    raise AssertionError(mode)


def test_normalizers():
    mask = make_mask()
    n = compute_loss_normalizers(mask, max_len=MAX_LEN)
    expected_counts = [n_ - (1 if i == 0 else 0) for i, n_ in enumerate(LENGTHS)]
    assert n.seq_token_counts.tolist() == expected_counts
    assert n.num_tokens.item() == sum(expected_counts)
    assert n.num_sequences.item() == 7  # row 2 is all padding
    kw = n.for_rows([1, 3])
    assert kw["seq_token_counts"].tolist() == [3, 5] and kw["max_len"] == MAX_LEN
    assert n.for_rows()["global_num_tokens"] is n.num_tokens


@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_full_batch_value_matches_definition(mode):
    mask = make_mask()
    loss = _per_token_loss(randn(B, T, seed=40))
    # garbage (NaN) at padded positions must not leak into the value
    loss = torch.where(mask, loss, torch.nan)
    value = reduce_loss(loss, mask, mode, **compute_loss_normalizers(mask, MAX_LEN).for_rows())
    assert value.item() == pytest.approx(_ref_reduce(loss.tolist(), mask.tolist(), mode), rel=1e-13)


def _full_grad(mode):
    mask = make_mask()
    lp = randn(B, T, seed=40).requires_grad_()
    norms = compute_loss_normalizers(mask, MAX_LEN)
    loss = reduce_loss(_per_token_loss(lp), mask, mode, **norms.for_rows())
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, mask, norms


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_split_gradient_equals_full_batch(mode, split):
    full_value, full_grad, mask, norms = _full_grad(mode)
    lp = randn(B, T, seed=40).requires_grad_()
    per_token = _per_token_loss(lp)
    total = torch.zeros((), dtype=torch.float64)
    grad = torch.zeros_like(lp)
    for rows in SPLITS[split]:
        cols = trimmed_columns(mask, rows)  # each micro-batch padded only to its own length
        piece = reduce_loss(per_token[rows][:, cols], mask[rows][:, cols], mode, **norms.for_rows(rows))
        (g,) = torch.autograd.grad(piece, lp, retain_graph=True)
        grad += g
        total += piece.detach()
    torch.testing.assert_close(total, full_value, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, full_grad, rtol=0, atol=1e-12)
    assert full_grad[mask].abs().min() > 0 and (full_grad[~mask] == 0).all()


@pytest.mark.parametrize("col_cuts", [[3], [1, 4], [2, 5, 6]])
@pytest.mark.parametrize("mode", REDUCTION_MODES)
def test_context_parallel_shards_with_global_seq_counts(mode, col_cuts):
    full_value, full_grad, mask, norms = _full_grad(mode)
    lp = randn(B, T, seed=40).requires_grad_()
    per_token = _per_token_loss(lp)
    bounds = [0, *col_cuts, T]
    grad = torch.zeros_like(lp)
    total = torch.zeros((), dtype=torch.float64)
    for rows in SPLITS["4x2"]:
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            piece = reduce_loss(per_token[rows][:, lo:hi], mask[rows][:, lo:hi], mode, **norms.for_rows(rows))
            (g,) = torch.autograd.grad(piece, lp, retain_graph=True)
            grad += g
            total += piece.detach()
    torch.testing.assert_close(total, full_value, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, full_grad, rtol=0, atol=1e-12)


def test_local_normalisers_would_be_wrong():
    """Guard against a vacuous split test: per-micro-batch means do NOT reproduce the full gradient."""
    for mode in ("token_mean", "sequence_mean"):
        _, full_grad, mask, norms = _full_grad(mode)
        lp = randn(B, T, seed=40).requires_grad_()
        per_token = _per_token_loss(lp)
        grad = torch.zeros_like(lp)
        for rows in SPLITS["4x2"]:
            local = compute_loss_normalizers(mask[rows], MAX_LEN)
            piece = reduce_loss(per_token[rows], mask[rows], mode, **local.for_rows()) / len(SPLITS["4x2"])
            (g,) = torch.autograd.grad(piece, lp, retain_graph=True)
            grad += g
        assert not torch.allclose(grad, full_grad, atol=1e-6)
    # and sequence_mean under CP needs the GLOBAL per-sequence counts
    _, full_grad, mask, norms = _full_grad("sequence_mean")
    lp = randn(B, T, seed=40).requires_grad_()
    per_token = _per_token_loss(lp)
    grad = torch.zeros_like(lp)
    for lo, hi in ((0, 3), (3, T)):
        kw = norms.for_rows()
        kw["seq_token_counts"] = None  # local counts of the shard: wrong
        (g,) = torch.autograd.grad(reduce_loss(per_token[:, lo:hi], mask[:, lo:hi], "sequence_mean", **kw), lp, retain_graph=True)
        grad += g
    assert not torch.allclose(grad, full_grad, atol=1e-6)


def test_empty_inputs_and_errors():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss = torch.full((2, 3), torch.nan, dtype=torch.float64)
    norms = compute_loss_normalizers(mask, max_len=4).for_rows()
    for mode in REDUCTION_MODES:
        assert reduce_loss(loss, mask, mode, **norms).item() == 0.0
    ok = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="global_num_tokens"):
        reduce_loss(loss, ok, "token_mean")
    with pytest.raises(ValueError, match="global_num_sequences"):
        reduce_loss(loss, ok, "sequence_mean")
    with pytest.raises(ValueError, match="max_len"):
        reduce_loss(loss, ok, "seq_mean_token_sum_norm", global_num_sequences=2)
    with pytest.raises(ValueError, match="choices: token_mean, sequence_mean, seq_mean_token_sum_norm"):
        reduce_loss(loss, ok, "mean", global_num_tokens=6)
    with pytest.raises(ValueError, match="seq_token_counts"):
        reduce_loss(loss, ok, "sequence_mean", global_num_sequences=2, seq_token_counts=torch.ones(3))
    with pytest.raises(ValueError, match="shape"):
        reduce_loss(loss, torch.ones(2, 2, dtype=torch.bool), "token_mean", global_num_tokens=6)


def test_python_number_normalisers():
    mask = make_mask()
    loss = _per_token_loss(randn(B, T, seed=40))
    n = compute_loss_normalizers(mask, MAX_LEN)
    a = reduce_loss(loss, mask, "token_mean", global_num_tokens=n.num_tokens)
    b = reduce_loss(loss, mask, "token_mean", global_num_tokens=int(n.num_tokens))
    assert a.item() == b.item()
