"""Pure tensor functions for RL post-training (no Megatron, no distributed calls).

Modules, one job each:
  advantages     rewards [B] + groups -> token advantages [B, T]
  policy_losses  logprobs / old logprobs / advantages [B, T] -> per-token loss [B, T] + metrics
  off_policy     old vs rollout-engine logprobs [B, T] -> detached weights [B, T] + mask
  kl             logprobs vs reference logprobs -> per-token KL estimate
  entropy        logits [*, V] -> entropy [*]
  reductions     per-token loss [b, t] -> split-invariant partial sum (global normalisers)

``compute_policy_loss`` below combines them for one micro-batch.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
)
from .entropy import entropy_from_logits
from .kl import KL_ESTIMATORS, get_kl_estimator, kl_penalty, register_kl_estimator
from .off_policy import (
    OFF_POLICY_CORRECTIONS,
    OffPolicyCorrection,
    get_off_policy_correction,
    register_off_policy_correction,
)
from .policy_losses import POLICY_LOSSES, get_policy_loss, register_policy_loss
from .reductions import REDUCTION_MODES, LossNormalizers, compute_loss_normalizers, reduce_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "REDUCTION_MODES",
    "LossNormalizers",
    "OffPolicyCorrection",
    "compute_advantages",
    "compute_loss_normalizers",
    "compute_policy_loss",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_off_policy_correction",
    "get_policy_loss",
    "kl_penalty",
    "reduce_loss",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_off_policy_correction",
    "register_policy_loss",
]


def compute_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    policy_loss: str | Callable = "ppo",
    policy_loss_kwargs: dict | None = None,
    reduction: str = "token_mean",
    global_num_tokens: Tensor | float | None = None,
    global_num_sequences: Tensor | float | None = None,
    max_len: int | None = None,
    seq_token_counts: Tensor | None = None,
    off_policy: str | OffPolicyCorrection | None = None,
    off_policy_kwargs: dict | None = None,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: float | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of one micro-batch (all inputs [b, t]); returns ``(loss_sum, metric_sums)``.

    ``loss = R(pg * w) + kl_coef * R(kl) - entropy_coef * R(entropy)`` where ``R`` is
    ``reduce_loss(..., mode=reduction, <global normalisers>)`` over the training mask, ``pg``
    the per-token policy loss, ``w`` the off-policy weights (1 if ``off_policy`` is None).
    The training mask is ``mask`` minus sequences dropped by the off-policy correction; those
    stay counted in the global normalisers you pass (compute the normalisers from the
    corrected full-batch mask if they should not). The KL and entropy terms are not weighted.

    ``off_policy``: a correction name (computed here from ``old_logprobs`` vs ``rollout_logprobs``)
    or a precomputed ``OffPolicyCorrection`` for exactly these rows/columns (needed for
    sequence-level corrections under context parallelism).

    The returned loss and every ``*_loss`` metric are partial sums: add them over micro-batches
    and ranks to get the global values. ``token_sum/<name>`` metrics are sums over the valid
    tokens of per-token metrics; divide by the summed ``num_tokens`` for means (e.g.
    ``token_sum/pg/clipped`` -> clip fraction). KL / entropy are reported whenever
    ``ref_logprobs`` / ``entropy`` are given, but enter the loss only with a non-zero coefficient.
    """
    mask = mask.bool()
    norms = dict(
        global_num_tokens=global_num_tokens,
        global_num_sequences=global_num_sequences,
        max_len=max_len,
        seq_token_counts=seq_token_counts,
    )
    loss_fn = get_policy_loss(policy_loss) if isinstance(policy_loss, str) else policy_loss
    pg, pg_metrics = loss_fn(logprobs, old_logprobs, advantages, mask, **(policy_loss_kwargs or {}))
    token_metrics = {f"pg/{k}": v for k, v in pg_metrics.items()}

    train_mask = mask
    if off_policy is not None:
        if isinstance(off_policy, OffPolicyCorrection):
            correction = off_policy
        else:
            if rollout_logprobs is None:
                raise ValueError(f"off_policy={off_policy!r} needs rollout_logprobs")
            correction = get_off_policy_correction(off_policy)(
                old_logprobs, rollout_logprobs, mask, **(off_policy_kwargs or {})
            )
        pg = pg * correction.weights.detach()
        train_mask = mask & correction.mask.bool()
        token_metrics.update({f"off_policy/{k}": v for k, v in correction.metrics.items()})

    def reduce(x: Tensor) -> Tensor:
        return reduce_loss(x, train_mask, reduction, **norms)

    pg_loss = reduce(pg)
    loss = pg_loss
    sums = {"pg_loss": pg_loss.detach()}

    if ref_logprobs is not None or kl_coef != 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef != 0 needs ref_logprobs")
        safe_logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
        safe_ref = torch.where(mask, ref_logprobs, torch.zeros_like(ref_logprobs)).detach()
        kl_loss = reduce(kl_penalty(safe_logprobs, safe_ref, kl_estimator, clamp=kl_clamp))
        if kl_coef != 0.0:
            loss = loss + kl_coef * kl_loss
        sums["kl_loss"] = kl_loss.detach()

    if entropy is not None or entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs entropy")
        entropy_loss = reduce(torch.where(mask, entropy, torch.zeros_like(entropy)))
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * entropy_loss
        sums["entropy_loss"] = entropy_loss.detach()

    sums["loss"] = loss.detach()
    sums["num_tokens"] = mask.sum()
    sums["num_train_tokens"] = train_mask.sum()
    for name, value in token_metrics.items():
        sums[f"token_sum/{name}"] = torch.where(mask, value.detach(), torch.zeros_like(value)).sum()
    return loss, sums
