"""Token logprobs and entropy from vocab-parallel logits, without gathering the vocabulary.

In:  `logits` [..., V/tp] (this TP rank's vocabulary slice, as megatron's output layer gives
     them), `labels` [...] global token ids, a temperature, the TP group.
Out: `(logprobs [...], entropy [...] or None)` in float32, identical on every TP rank, with
     gradients w.r.t. the local logits (backward needs no communication).

With x = logits / T (temperature applied as at sampling) and ids >= `vocab_size` (megatron's
vocabulary padding) excluded:
    m       = all_reduce_max(max_v x_v)                      (no gradient: any constant works)
    S       = all_reduce_sum(sum_v exp(x_v - m))
    logZ    = m + log S
    x_y     = all_reduce_sum(x_y if this rank owns label y else 0)
    logprob = x_y - logZ
    entropy = logZ - all_reduce_sum(sum_v p_v x_v),   p_v = exp(x_v - logZ)
Gradients (local slice): d logprob / dx_v = 1[v=y] - p_v; d entropy / dx_v = -p_v (x_v - E_p[x]).

Alignment with the rollout: the logits at position p predict the token at p+1; callers pass
`labels` = next tokens (`packing.MicroBatchLayout.next_token_labels`), so the logprob of token t
is read at position t-1, the rollout engine's convention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _tp_info(tp_group):
    if tp_group is None:
        try:
            from megatron.core import parallel_state as mpu

            if mpu.model_parallel_is_initialized():
                tp_group = mpu.get_tensor_model_parallel_group()
        except Exception:  # megatron not importable / not initialised: single rank
            tp_group = None
    if tp_group is None or not dist.is_initialized():
        return None, 1, 0
    return tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, vocab_size, with_entropy, entropy_grad, tp_group, tp_size,
                tp_rank):
        x = logits if logits.dtype == torch.float64 else logits.float()
        if temperature != 1.0:
            x = x / temperature
        v_local = x.shape[-1]
        start = tp_rank * v_local
        valid_vocab = None
        if vocab_size is not None and start + v_local > vocab_size:
            valid_vocab = torch.arange(start, start + v_local, device=x.device) < vocab_size
            x = x.masked_fill(~valid_vocab, float("-inf"))

        def all_reduce(t, op=dist.ReduceOp.SUM):
            if tp_size > 1:
                dist.all_reduce(t, op=op, group=tp_group)
            return t

        m = all_reduce(x.max(-1).values, dist.ReduceOp.MAX)
        p = torch.exp(x - m.unsqueeze(-1))
        s = all_reduce(p.sum(-1))
        log_z = m + torch.log(s)
        p.div_(s.unsqueeze(-1))  # the local slice of the full softmax

        local = labels - start
        owned = (local >= 0) & (local < v_local)
        idx = local.clamp(0, v_local - 1).unsqueeze(-1)
        target = torch.where(owned, x.gather(-1, idx).squeeze(-1), torch.zeros_like(log_z))
        target = all_reduce(target)
        logprobs = target - log_z

        entropy = None
        mean_x = None
        if with_entropy:
            px = p * x
            if valid_vocab is not None:
                px = px.masked_fill(~valid_vocab, 0.0)
            mean_x = all_reduce(px.sum(-1))
            entropy = log_z - mean_x
        keep_x = with_entropy and entropy_grad
        ctx.save_for_backward(p, x if keep_x else None, mean_x if keep_x else None, idx, owned)
        ctx.temperature = temperature
        ctx.valid_vocab = valid_vocab
        ctx.in_dtype = logits.dtype
        if entropy is None:
            entropy = torch.zeros_like(logprobs)
        if not keep_x:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        p, x, mean_x, idx, owned = ctx.saved_tensors
        grad = torch.zeros_like(p)
        if grad_logprobs is not None:
            grad = -p * grad_logprobs.unsqueeze(-1)
            onehot_grad = torch.where(owned, grad_logprobs, torch.zeros_like(grad_logprobs)).unsqueeze(-1)
            grad.scatter_add_(-1, idx, onehot_grad)
        if grad_entropy is not None and x is not None:
            centred = x - mean_x.unsqueeze(-1)
            if ctx.valid_vocab is not None:
                centred = centred.masked_fill(~ctx.valid_vocab, 0.0)
            grad = grad - p * centred * grad_entropy.unsqueeze(-1)
        if ctx.temperature != 1.0:
            grad = grad / ctx.temperature
        return grad.to(ctx.in_dtype), None, None, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0, *,
                            with_entropy: bool = False, entropy_grad: bool = True, vocab_size: int | None = None,
                            tp_group=None) -> tuple[Tensor, Tensor | None]:
    """(logprobs, entropy or None), float32, shape of `labels` (see module docstring).

    `logits` [..., V/tp] are this rank's vocab slice (the full vocab when TP=1); `tp_group`
    defaults to megatron's TP group (none when megatron is not initialised). `entropy_grad=False`
    returns a constant entropy (a metric) and saves the memory its backward would need."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    group, size, rank = _tp_info(tp_group)
    lp, ent = _VocabParallelLogprobEntropy.apply(
        logits, labels.long(), float(temperature), vocab_size, with_entropy, entropy_grad, group, size, rank
    )
    return lp, (ent if with_entropy else None)


def vocab_parallel_entropy(logits: Tensor, temperature: float = 1.0, *, vocab_size: int | None = None,
                           tp_group=None) -> Tensor:
    """Entropy [...] of softmax(logits / T) from vocab-parallel logits [..., V/tp]."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return vocab_parallel_logprobs(logits, labels, temperature, with_entropy=True, vocab_size=vocab_size,
                                   tp_group=tp_group)[1]


def reference_logprobs(full_logits: Tensor, labels: Tensor, temperature: float = 1.0,
                       vocab_size: int | None = None) -> tuple[Tensor, Tensor]:
    """float64 (logprobs, entropy) from full-vocabulary logits: the test reference."""
    x = full_logits.double() / temperature
    if vocab_size is not None:
        x = x[..., :vocab_size]
    logp = torch.log_softmax(x, -1)
    lp = logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent
