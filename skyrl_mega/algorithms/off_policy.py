"""Off-policy corrections for the rollout-engine / trainer mismatch.

The rollout engine samples with its own numerics (``rollout_logprobs``); the trainer
recomputes ``old_logprobs`` for the same tokens. The PPO-style ratio uses
``old_logprobs``, so the samples are off-policy by ``old / rollout``; these functions turn
that gap into per-token loss weights and/or a mask.

In:  ``old_logprobs`` [B, T], ``rollout_logprobs`` [B, T], ``mask`` [B, T] (bool or 0/1).
Out: ``OffPolicyCorrection(weights [B, T], mask [B, T] bool, metrics {name: [B, T]})``:
     ``weights`` are detached (no gradient), 0 at masked or dropped tokens; ``mask`` is the
     input mask minus dropped sequences; ``metrics`` are per-token, 0 at input-masked tokens.

Sequence-level corrections need whole sequences: with context parallelism compute them on
the full (unsharded) sequences and slice the result (``OffPolicyCorrection.select``).

Registry: ``OFF_POLICY_CORRECTIONS``; ``@register_off_policy_correction("name")`` on
``fn(old_logprobs, rollout_logprobs, mask, **kw) -> OffPolicyCorrection``,
``get_off_policy_correction("name")``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._registry import make_registry

OFF_POLICY_CORRECTIONS, register_off_policy_correction, get_off_policy_correction = make_registry(
    "off-policy correction"
)


@dataclass(frozen=True)
class OffPolicyCorrection:
    weights: Tensor  # [B, T] detached per-token loss weights
    mask: Tensor  # [B, T] bool, tokens that stay in the loss
    metrics: dict[str, Tensor]  # per-token [B, T]

    def select(self, index) -> "OffPolicyCorrection":
        """Apply the same indexing (rows of a micro-batch, a context-parallel column slice) to every tensor."""
        return OffPolicyCorrection(
            self.weights[index], self.mask[index], {k: v[index] for k, v in self.metrics.items()}
        )


def _log_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    diff = (old_logprobs - rollout_logprobs).detach()
    return torch.where(mask, diff, torch.zeros_like(diff))


def _mask_out(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros_like(x))


@register_off_policy_correction("tis")
def token_tis(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, cap: float = 2.0) -> OffPolicyCorrection:
    """Token-level truncated IS: ``w_t = min(exp(old_t - rollout_t), cap)``.

    Metrics: ``is_weight`` (w), ``is_truncated`` (token ratio > cap), ``is_log_ratio``.
    """
    mask = mask.bool()
    lr = _log_ratio(old_logprobs, rollout_logprobs, mask)
    weights = lr.exp().clamp(max=cap)
    metrics = {
        "is_weight": _mask_out(weights, mask),
        "is_truncated": (mask & (lr > math.log(cap))).to(lr.dtype),
        "is_log_ratio": lr,
    }
    return OffPolicyCorrection(_mask_out(weights, mask), mask, metrics)


@register_off_policy_correction("seq_tis")
def sequence_tis(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, cap: float = 2.0
) -> OffPolicyCorrection:
    """Sequence-level truncated IS: ``w_i = min(prod_t exp(old_t - rollout_t), cap)`` on every token of i.

    Computed in log space (``exp(min(sum_t lr_t, log cap))``), so long sequences cannot overflow.
    Metrics: ``is_weight``, ``is_truncated`` (sequence ratio > cap, on each of its tokens).
    """
    mask = mask.bool()
    seq_lr = _log_ratio(old_logprobs, rollout_logprobs, mask).sum(-1)
    log_cap = math.log(cap)
    seq_w = seq_lr.clamp(max=log_cap).exp().clamp(max=cap)  # exactly cap when truncated
    weights = _mask_out(seq_w[:, None].expand(mask.shape), mask)
    truncated = mask & (seq_lr > log_cap)[:, None]
    metrics = {"is_weight": weights, "is_truncated": truncated.to(weights.dtype)}
    return OffPolicyCorrection(weights, mask, metrics)


@register_off_policy_correction("mis")
def masked_is(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
    seq_ratio: str = "geometric",
    use_weight: bool = True,
) -> OffPolicyCorrection:
    """Masked IS: drop whole sequences whose sequence ratio ``rho_i`` is outside ``[low, high]``.

    ``rho_i = exp(mean_t lr_t)`` for ``seq_ratio="geometric"``, ``exp(sum_t lr_t)`` for ``"product"``
    (``lr_t = old_t - rollout_t`` over valid tokens). Kept sequences get weight ``rho_i``
    (or 1 with ``use_weight=False``, pure rejection), dropped ones weight 0 and are removed
    from the returned mask. All-pad rows have ``rho = 1``.
    Metrics: ``is_weight``, ``is_rejected`` (token of a dropped sequence).
    """
    if not 0 < low <= high:
        raise ValueError(f"need 0 < low <= high, got low={low}, high={high}")
    mask = mask.bool()
    seq_lr = _log_ratio(old_logprobs, rollout_logprobs, mask).sum(-1)
    if seq_ratio == "geometric":
        seq_lr = seq_lr / mask.sum(-1).clamp(min=1)
    elif seq_ratio != "product":
        raise ValueError(f"seq_ratio must be 'geometric' or 'product', got {seq_ratio!r}")
    keep = (seq_lr >= math.log(low)) & (seq_lr <= math.log(high))
    seq_w = seq_lr.exp() if use_weight else torch.ones_like(seq_lr)
    kept_mask = mask & keep[:, None]
    weights = _mask_out(seq_w[:, None].expand(mask.shape), kept_mask)
    metrics = {"is_weight": weights, "is_rejected": (mask & ~keep[:, None]).to(weights.dtype)}
    return OffPolicyCorrection(weights, kept_mask, metrics)
