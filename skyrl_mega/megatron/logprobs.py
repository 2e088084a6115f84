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

Memory: the flattened token axis is processed in chunks (`chunk_tokens`, default "auto": an fp32
[chunk, V/tp] slab of at most `AUTO_CHUNK_BYTES`), forward and backward, with the all-reduces per
chunk. Backward keeps only the input logits in their own dtype and per-token m, S (and E_p[x]
when the entropy has a gradient), recomputes each chunk's softmax with the forward's operations
and writes the chunk's gradient into one gradient tensor of the logits' dtype. So no fp32
[tokens, V/tp] tensor exists for the whole micro-batch (at 16K tokens x 248K vocabulary one is
16 GB); the price is the backward's recomputation of x and p (bench/logprob_memory.py).

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


# chunk_tokens="auto": the largest power of two of tokens whose fp32 [chunk, V/tp] slab is at most
# this many bytes. Forward and backward each hold about two such slabs plus the chunk of the input
# logits, whatever the micro-batch's token count. 1 GiB: 1024 tokens of a 248320-entry vocabulary
# at TP=1, 8192 at TP=8 (BENCHMARKS.md: 16K tokens x 248320 on an H200, forward+backward 9.5 GiB
# above the inputs, 7.6 of them the bf16 gradient, vs 91 GiB before chunking; 256 MiB chunks
# saved 1.4 GiB more at 6% more time).
AUTO_CHUNK_BYTES = 1 << 30


def chunk_size(chunk_tokens, n_tokens: int, v_local: int) -> int:
    """Tokens per chunk: `chunk_tokens` ("auto", an int, or 0/None for one chunk of all tokens)."""
    if chunk_tokens == "auto":
        fit = max(1, AUTO_CHUNK_BYTES // (4 * max(v_local, 1)))
        chunk_tokens = 1 << (fit.bit_length() - 1)
    elif chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 0):
        raise ValueError(f"chunk_tokens must be 'auto', None or an int >= 0, got {chunk_tokens!r}")
    return max(1, min(chunk_tokens or n_tokens, n_tokens))


def _scaled(chunk: Tensor, temperature: float, valid_vocab) -> Tensor:
    """x = chunk / T in float32 (float64 stays float64), padded vocabulary at -inf; a new tensor."""
    x = chunk.to(torch.float64 if chunk.dtype == torch.float64 else torch.float32, copy=True)
    if temperature != 1.0:
        x.div_(temperature)
    if valid_vocab is not None:
        x.masked_fill_(~valid_vocab, float("-inf"))
    return x


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """Token-chunked: every [chunk, V/tp] working tensor is per chunk; backward keeps the input
    logits (their own dtype) and per-token m, S (and E_p[x] when the entropy has a gradient), and
    recomputes each chunk's softmax p = exp(x - m) / S with the forward's exact operations."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, vocab_size, with_entropy, entropy_grad, tp_group, tp_size,
                tp_rank, chunk):
        v_local = logits.shape[-1]
        flat = logits.reshape(-1, v_local)
        lab = labels.reshape(-1)
        n = flat.shape[0]
        wdtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        start = tp_rank * v_local
        valid_vocab = None
        if vocab_size is not None and start + v_local > vocab_size:
            valid_vocab = torch.arange(start, start + v_local, device=logits.device) < vocab_size

        def all_reduce(t, op=dist.ReduceOp.SUM):
            if tp_size > 1:  # every rank has the same tokens, hence the same chunks, in order
                dist.all_reduce(t, op=op, group=tp_group)
            return t

        def new(dt=wdtype):
            return torch.empty(n, dtype=dt, device=logits.device)

        m_all, s_all, logprobs = new(), new(), new()
        mean_all = new() if with_entropy else None
        entropy = new() if with_entropy else None
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            x = _scaled(flat[a:b], temperature, valid_vocab)
            m = all_reduce(x.max(-1).values, dist.ReduceOp.MAX)
            p = (x - m.unsqueeze(-1)).exp_()
            s = all_reduce(p.sum(-1))
            log_z = m + torch.log(s)
            p.div_(s.unsqueeze(-1))  # the local slice of the full softmax

            local = lab[a:b] - start
            owned = (local >= 0) & (local < v_local)
            idx = local.clamp(0, v_local - 1).unsqueeze(-1)
            target = torch.where(owned, x.gather(-1, idx).squeeze(-1), torch.zeros_like(log_z))
            target = all_reduce(target)
            logprobs[a:b] = target - log_z
            m_all[a:b], s_all[a:b] = m, s
            if with_entropy:
                px = p.mul_(x)
                if valid_vocab is not None:
                    px.masked_fill_(~valid_vocab, 0.0)
                mean_x = all_reduce(px.sum(-1))
                mean_all[a:b] = mean_x
                entropy[a:b] = log_z - mean_x
            del x, p
        keep_x = with_entropy and entropy_grad
        ctx.save_for_backward(logits, lab, m_all, s_all, mean_all if keep_x else None)
        ctx.temperature = temperature
        ctx.valid_vocab = valid_vocab
        ctx.start = start
        ctx.chunk = chunk
        logprobs = logprobs.view(labels.shape)
        entropy = torch.zeros_like(logprobs) if entropy is None else entropy.view(labels.shape)
        if not keep_x:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, lab, m_all, s_all, mean_all = ctx.saved_tensors
        v_local = logits.shape[-1]
        flat = logits.reshape(-1, v_local)
        n = flat.shape[0]
        grad = torch.empty((n, v_local), dtype=logits.dtype, device=logits.device)
        g_lp = grad_logprobs.reshape(-1) if grad_logprobs is not None else None
        g_ent = grad_entropy.reshape(-1) if (grad_entropy is not None and mean_all is not None) else None
        for a in range(0, n, ctx.chunk):
            b = min(a + ctx.chunk, n)
            x = _scaled(flat[a:b], ctx.temperature, ctx.valid_vocab)
            p = (x - m_all[a:b].unsqueeze(-1)).exp_().div_(s_all[a:b].unsqueeze(-1))
            ent_term = None
            if g_ent is not None:  # p (x - E_p[x]) dEntropy, into x's storage
                ent_term = x.sub_(mean_all[a:b].unsqueeze(-1))
                if ctx.valid_vocab is not None:
                    ent_term.masked_fill_(~ctx.valid_vocab, 0.0)
                ent_term.mul_(p).mul_(g_ent[a:b].unsqueeze(-1))
            if g_lp is not None:  # (1[v=y] - p) dLogprob, into p's storage
                g = p.mul_(-g_lp[a:b].unsqueeze(-1))
                local = lab[a:b] - ctx.start
                owned = (local >= 0) & (local < v_local)
                idx = local.clamp(0, v_local - 1).unsqueeze(-1)
                onehot = torch.where(owned, g_lp[a:b], torch.zeros_like(g_lp[a:b])).unsqueeze(-1)
                g.scatter_add_(-1, idx, onehot)
                if ent_term is not None:
                    g.sub_(ent_term)
            elif ent_term is not None:
                g = ent_term.neg_()
            else:
                g = p.zero_()
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)
            grad[a:b].copy_(g)
            del x, p, g, ent_term
        return grad.view(logits.shape), None, None, None, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0, *,
                            with_entropy: bool = False, entropy_grad: bool = True, vocab_size: int | None = None,
                            tp_group=None, chunk_tokens: int | str | None = "auto") -> tuple[Tensor, Tensor | None]:
    """(logprobs, entropy or None), float32, shape of `labels` (see module docstring).

    `logits` [..., V/tp] are this rank's vocab slice (the full vocab when TP=1); `tp_group`
    defaults to megatron's TP group (none when megatron is not initialised). `entropy_grad=False`
    returns a constant entropy (a metric) and saves the memory its backward would need.

    `chunk_tokens`: tokens (of the flattened leading axes) per chunk; every float32 [chunk, V/tp]
    tensor lives for one chunk, forward and backward. "auto" bounds such a tensor by
    `AUTO_CHUNK_BYTES`; 0 / None: one chunk of all tokens (the unchunked baseline). The values
    do not depend on it beyond float32 summation order within rows (identical per row here)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    group, size, rank = _tp_info(tp_group)
    chunk = chunk_size(chunk_tokens, labels.numel(), logits.shape[-1])
    lp, ent = _VocabParallelLogprobEntropy.apply(
        logits, labels.long(), float(temperature), vocab_size, with_entropy, entropy_grad, group, size, rank, chunk
    )
    return lp, (ent if with_entropy else None)


def vocab_parallel_entropy(logits: Tensor, temperature: float = 1.0, *, vocab_size: int | None = None,
                           tp_group=None, chunk_tokens: int | str | None = "auto") -> Tensor:
    """Entropy [...] of softmax(logits / T) from vocab-parallel logits [..., V/tp]."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return vocab_parallel_logprobs(logits, labels, temperature, with_entropy=True, vocab_size=vocab_size,
                                   tp_group=tp_group, chunk_tokens=chunk_tokens)[1]


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
