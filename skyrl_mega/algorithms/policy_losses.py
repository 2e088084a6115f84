"""Per-token policy-gradient losses.

In:  ``logprobs`` [B, T] (current policy, carries the gradient),
     ``old_logprobs`` [B, T] (behaviour policy; treated as a constant),
     ``advantages`` [B, T] (treated as a constant), ``mask`` [B, T] (bool or 0/1).
Out: ``(loss [B, T], metrics)``: the per-token loss to be *minimised* (0 at masked
     positions, unreduced -- see ``reductions.py``) and a dict of per-token metric
     tensors [B, T] (0 at masked positions; e.g. ``clipped`` is a 0/1 indicator whose
     masked mean is the clip fraction).

Values at masked positions may be garbage (even inf/NaN): they never reach the
loss value or the gradient.

Registry: ``POLICY_LOSSES``; add one with ``@register_policy_loss("name")`` on a
function ``fn(logprobs, old_logprobs, advantages, mask, **kw) -> (loss, metrics)``,
look one up with ``get_policy_loss("name")``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._registry import make_registry

POLICY_LOSSES, register_policy_loss, get_policy_loss = make_registry("policy loss")


def masked_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``logprobs - old_logprobs`` on valid tokens, 0 elsewhere (gradient flows into ``logprobs`` only)."""
    diff = logprobs - old_logprobs.detach()
    return torch.where(mask.bool(), diff, torch.zeros_like(diff))


def _mask_out(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros_like(x))


def _clip_objective(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """PPO pessimistic objective ``max(-A r, -A clip(r, 1-eps_low, 1+eps_high))`` and the clipped flag."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    is_clipped = clipped > unclipped  # clip active: the clipped branch wins and has no gradient
    return torch.where(is_clipped, clipped, unclipped), is_clipped


@register_policy_loss("ppo")
def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip with asymmetric range and optional dual clip.

    ``r = exp(logprobs - old_logprobs)``,
    ``loss = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` (``eps_high`` defaults to ``eps_low``).
    Dual clip (``clip_ratio_c`` > 1, only where ``A < 0``): ``loss = min(loss, -A * clip_ratio_c)``,
    which bounds the loss (and zeroes the gradient) when ``r > clip_ratio_c``.

    Metrics: ``ratio``, ``clipped`` (the clip range was active), ``dual_clipped``,
    ``approx_kl`` (``old_logprobs - logprobs``, the k1 estimate of KL(old || new)).
    """
    eps_high = eps_low if eps_high is None else eps_high
    mask = mask.bool()
    adv = _mask_out(advantages.detach(), mask)
    log_ratio = masked_log_ratio(logprobs, old_logprobs, mask)
    ratio = log_ratio.exp()
    loss, is_clipped = _clip_objective(ratio, adv, eps_low, eps_high)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        cap = -adv * clip_ratio_c
        dual_clipped = (adv < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
    else:
        dual_clipped = torch.zeros_like(mask)
    metrics = {
        "ratio": _mask_out(ratio.detach(), mask),
        "clipped": (is_clipped & mask).to(ratio.dtype),
        "dual_clipped": (dual_clipped & mask).to(ratio.dtype),
        "approx_kl": _mask_out(-log_ratio.detach(), mask),
    }
    return _mask_out(loss, mask), metrics


@register_policy_loss("gspo")
def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    seq_log_ratio: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO clipping on the sequence-level ratio, broadcast to tokens.

    ``s_i = exp(mean_{t valid} (logprobs - old_logprobs))`` (length-normalised, i.e. a geometric mean),
    ``loss_it = max(-A_it s_i, -A_it clip(s_i, 1 - eps_low, 1 + eps_high))`` on valid tokens.
    Advantages are expected to be constant over a sequence (as all estimators here produce).
    The gradient flows through ``s_i``, i.e. into every token of the sequence.
    Defaults follow the GSPO paper's ranges (3e-4 / 4e-4).

    Context parallel: a shard only sees part of each sequence, so ``s_i`` cannot be formed
    locally. Pass ``seq_log_ratio`` [B] (the *detached* full-sequence mean log-ratio, e.g. from an
    all-reduce of per-shard sums and the global token counts). Then the "GSPO-token" form
    ``s_it = exp(sg[seq_log_ratio_i] + l_it - sg[l_it])`` is used: its value is ``s_i`` on every token
    and, under any reduction that weights the tokens of a sequence uniformly (all of
    ``reductions.py``), its gradient equals the sequence-level one.

    Metrics: ``ratio`` (``s_i`` on each token), ``clipped``.
    """
    mask = mask.bool()
    adv = _mask_out(advantages.detach(), mask)
    log_ratio = masked_log_ratio(logprobs, old_logprobs, mask)
    if seq_log_ratio is None:
        num_tokens = mask.sum(-1).clamp(min=1)
        seq_lr = log_ratio.sum(-1) / num_tokens
        ratio = seq_lr.exp()[:, None].expand_as(log_ratio)
    else:
        seq_lr = seq_log_ratio.detach().to(log_ratio.dtype)
        ratio = (seq_lr[:, None] + log_ratio - log_ratio.detach()).exp()
    loss, is_clipped = _clip_objective(ratio, adv, eps_low, eps_high)
    metrics = {
        "ratio": _mask_out(ratio.detach(), mask),
        "clipped": (is_clipped & mask).to(ratio.dtype),
    }
    return _mask_out(loss, mask), metrics


@register_policy_loss("cispo")
def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float | None = None,
    eps_high: float | None = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: clipped importance-sampling weight, stop-gradient, times advantage times logprob.

    ``w = sg[clip(exp(logprobs - old_logprobs), 1 - eps_low, 1 + eps_high)]`` (a ``None`` bound is open),
    ``loss = -w * A * logprobs``. Unlike PPO, no token loses its gradient: clipping only caps the weight.
    The loss *value* is not a surrogate objective; only its gradient ``-w A grad(logprobs)`` matters.

    Metrics: ``ratio`` (unclipped), ``clipped`` (weight was capped), ``is_weight`` (``w``).
    """
    mask = mask.bool()
    adv = _mask_out(advantages.detach(), mask)
    ratio = masked_log_ratio(logprobs, old_logprobs, mask).detach().exp()
    low = None if eps_low is None else 1.0 - eps_low
    high = None if eps_high is None else 1.0 + eps_high
    weight = ratio.clamp(min=low, max=high) if (low is not None or high is not None) else ratio
    loss = -weight * adv * logprobs
    metrics = {
        "ratio": _mask_out(ratio, mask),
        "clipped": ((weight != ratio) & mask).to(ratio.dtype),
        "is_weight": _mask_out(weight, mask),
    }
    return _mask_out(loss, mask), metrics
