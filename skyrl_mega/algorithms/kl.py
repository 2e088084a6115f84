"""KL-divergence estimators between the current and the reference policy.

In:  ``logprobs`` [*] (current policy, sampled tokens), ``ref_logprobs`` [*] (reference policy,
     same tokens).
Out: per-token estimate [*] of KL(current || ref) for tokens sampled from the current policy.
     No masking here: the caller masks/reduces (``reductions.py``).

With ``d = ref_logprobs - logprobs``:
  k1 = -d                      (unbiased, high variance, can be negative)
  k2 = 0.5 * d**2              (biased, low variance; as a loss its gradient is the true
                                reverse-KL gradient)
  k3 = exp(d) - d - 1          (unbiased, non-negative, low variance; "low_var_kl").
       Evaluated as ``expm1(d) - d`` with ``d`` capped at +20 inside the exponential so the
       value and gradient stay finite for absurd gaps (exp(20) ~ 5e8).

Registry: ``KL_ESTIMATORS`` (names k1/k2/k3 plus aliases kl, mse, low_var_kl);
``@register_kl_estimator("name")`` on ``fn(logprobs, ref_logprobs) -> Tensor``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._registry import make_registry

KL_ESTIMATORS, register_kl_estimator, get_kl_estimator = make_registry("KL estimator")

K3_MAX_LOG_RATIO = 20.0


@register_kl_estimator("k1")
@register_kl_estimator("kl")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = logprobs - ref_logprobs."""
    return logprobs - ref_logprobs


@register_kl_estimator("k2")
@register_kl_estimator("mse")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 0.5 * (logprobs - ref_logprobs)**2."""
    return 0.5 * (logprobs - ref_logprobs).square()


@register_kl_estimator("k3")
@register_kl_estimator("low_var_kl")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(d) - d - 1 with d = ref_logprobs - logprobs (d capped at +20 inside exp)."""
    d = ref_logprobs - logprobs
    return torch.expm1(d.clamp(max=K3_MAX_LOG_RATIO)) - d


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3", clamp: float | None = None
) -> Tensor:
    """Per-token KL estimate by estimator name, optionally clamped to ``[-clamp, clamp]``."""
    kl = get_kl_estimator(estimator)(logprobs, ref_logprobs)
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    return kl
