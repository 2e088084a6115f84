"""The gated delta rule (Gated DeltaNet, Qwen3.5's linear-attention layers) in plain PyTorch: the
CPU stand-ins for flash-linear-attention's `chunk_gated_delta_rule`, `fused_recurrent_gated_delta_rule`
(fla.ops.gated_delta_rule) and `l2norm` (fla.modules.l2norm), with the arguments, defaults and
layouts of fla 0.5.2 (heads after time, fla's head_first=False).

In:  q, k (B, T, H, K); v (B, T, HV, V) with HV a multiple of H (GVA: q / k head h serves value
     heads h*HV/H .. (h+1)*HV/H - 1, i.e. repeat_interleave); g (B, T, HV) the log decay (<= 0)
     and beta (B, T, HV) (the recurrent form also takes gk (B, T, HV, K), gv (B, T, HV, V) and a
     per-value beta (B, T, HV, V)); initial_state (N, HV, K, V) ((N, HV, V, K) with
     state_v_first); cu_seqlens (N + 1,) with B == 1: the T axis holds N packed sequences and the
     state restarts from initial_state[i] (or zero) at each sequence start.
Out: o (B, T, HV, V) (q's dtype for the chunked form, v's for the recurrent one, as fla) and, with
     output_final_state, the state after each sequence's last token (N, HV, K, V), in float32
     (float64 for float64 inputs); else None.

Per value head, with the state S (K x V), a_t = exp(g_t) and scale (default K ** -0.5):
    S'_t = a_t S_{t-1}                                      (decay first)
    S_t  = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T           (then the delta-rule write)
    o_t  = scale * S_t^T q_t                                (read after the write)
use_qk_l2norm_in_kernel first L2-normalises q and k (eps 1e-6), use_gate_in_kernel takes g raw and
uses -exp(A_log) softplus(g + dt_bias), use_beta_sigmoid_in_kernel takes beta as logits
(sigmoid, times 2 with allow_neg_eigval).

The chunked form works a chunk (chunk_size, default 64) at a time: inside a chunk of C tokens,
with G_t the decay accumulated since the chunk began and S_0 the state entering it, the
corrections w_t = beta_t (v_t - S'_t^T k_t) solve one unit lower-triangular system
    w_t + beta_t sum_{s<t} (G_t / G_s) (k_t . k_s) w_s = beta_t (v_t - G_t S_0^T k_t)
(so w = U - W S_0 with U, W per chunk, all chunks at once), then
    o_t = scale (G_t S_0^T q_t + sum_{s<=t} (G_t / G_s) (q_t . k_s) w_s),
    S_C = G_C S_0 + sum_s (G_C / G_s) k_s w_s^T,
one state carried between chunks: O(T * C) work, autograd gives the backward. Packed sequences
are laid out each padded to whole chunks (padding has k = v = beta = 0, g = 0: it leaves the
state alone), so no chunk straddles a boundary. The recurrent form steps token by token.
Math in float32 (float64 inputs stay float64).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _work_dtype(*tensors):
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(sum(x^2 over the last axis) + eps), computed in float32 (float64 stays), returned in
    output_dtype (default x's dtype)."""
    xw = x.to(_work_dtype(x))
    y = xw * torch.rsqrt(xw.pow(2).sum(-1, keepdim=True) + eps)
    return y.to(output_dtype if output_dtype is not None else x.dtype)


l2_norm = l2norm


def _check_varlen(q, initial_state, cu_seqlens):
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`. "
                         "Please flatten variable-length inputs before processing.")
    if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError(f"The number of initial states is expected to be equal to the number of input sequences, "
                         f"i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.")


def _prepare(q, k, v, g, beta, scale, initial_state, state_v_first, use_qk_l2norm_in_kernel,
             use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, work):
    """Work-dtype tensors with q / k repeated onto the value heads, q scaled, g and beta activated."""
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same number of heads, but got q.shape[2]={q.shape[2]} "
                         f"and k.shape[2]={k.shape[2]}")
    H, HV = q.shape[2], v.shape[2]
    if HV % H:
        raise ValueError(f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_heads (H={H}), "
                         f"but got HV % H = {HV % H}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if scale is None:
        scale = k.shape[-1] ** -0.5
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    if use_qk_l2norm_in_kernel:
        qw, kw = l2norm(qw), l2norm(kw)
    if HV != H:
        qw, kw = qw.repeat_interleave(HV // H, dim=2), kw.repeat_interleave(HV // H, dim=2)
    qw = qw * scale
    if g is not None:
        g = g.to(work)
        if use_gate_in_kernel:
            if A_log is None:
                raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True`.")
            if dt_bias is not None:
                g = g + dt_bias.to(work)
            g = -A_log.to(work).exp() * F.softplus(g)
    beta = beta.to(work)
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    init = None
    if initial_state is not None:
        init = initial_state.to(work)
        if state_v_first:
            init = init.transpose(-1, -2)
    return qw, kw, vw, g, beta, init


def _scan_chunks(q, k, v, g, beta, starts, C):
    """The chunked scan over (b, n*C, h, *) tensors. starts: {chunk index: state (b, h, K, V)
    entering it} (a sequence start). Out: o (b, n*C, h, V) and the state after every chunk."""
    b, T, h, dk = k.shape
    dv = v.shape[-1]
    n = T // C
    if n == 0:
        return q.new_zeros(b, 0, h, dv), []

    def chunked(t):  # (b, n*C, h, ...) -> (b, n, h, C, ...)
        return t.reshape(b, n, C, h, *t.shape[3:]).transpose(2, 3)

    q, k, v, g, beta = chunked(q), chunked(k), chunked(v), chunked(g), chunked(beta)
    lg = g.cumsum(-1)  # (b, n, h, C): log G_t
    diff = lg[..., :, None] - lg[..., None, :]  # [t, s] = log(G_t / G_s)
    ones = torch.ones(C, C, dtype=torch.bool, device=q.device)
    lower, strict = ones.tril(), ones.tril(-1)
    neg_inf = torch.full_like(diff, -math.inf)
    decay_incl = torch.exp(torch.where(lower, diff, neg_inf))  # G_t / G_s for s <= t, else 0
    decay_strict = torch.exp(torch.where(strict, diff, neg_inf))
    system = torch.eye(C, dtype=q.dtype, device=q.device) + beta[..., None] * decay_strict * (k @ k.transpose(-1, -2))
    U = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(system, (beta * lg.exp())[..., None] * k, upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay_incl  # (b, n, h, C, C)
    q_in = q * lg.exp()[..., None]  # reads the entering state
    k_out = k * torch.exp(lg[..., -1:] - lg)[..., None]  # writes to the chunk's end
    chunk_decay = lg[..., -1].exp()[..., None, None]  # (b, n, h, 1, 1)

    S = torch.zeros(b, h, dk, dv, dtype=q.dtype, device=q.device)
    outs, ends = [], []
    for c in range(n):
        if c in starts:
            S = starts[c]
        w = U[:, c] - W[:, c] @ S  # (b, h, C, V)
        outs.append(q_in[:, c] @ S + attn[:, c] @ w)
        S = chunk_decay[:, c] * S + k_out[:, c].transpose(-1, -2) @ w
        ends.append(S)
    o = torch.stack(outs, 1).transpose(2, 3).reshape(b, T, h, dv)
    return o, ends


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                           state_v_first: bool = False, cu_seqlens: torch.LongTensor | None = None,
                           cu_seqlens_cpu: torch.LongTensor | None = None, cp_context=None, **kwargs):
    """fla's chunked gated delta rule (see the module docstring). kwargs as fla: chunk_size (default 64;
    any positive size here), use_gate_in_kernel, A_log, dt_bias, chunk_indices (ignored),
    transpose_state_layout (the old name of state_v_first)."""
    if cp_context is not None:
        raise NotImplementedError("the CPU gated delta rule has no context parallelism (cp_context)")
    if kwargs.get("head_first"):
        raise ValueError("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    state_v_first = state_v_first or bool(kwargs.get("transpose_state_layout", False))
    C = int(kwargs.get("chunk_size", 64))
    if C < 1:
        raise ValueError(f"chunk_size must be positive, got {C}")
    _check_varlen(q, initial_state, cu_seqlens)
    work = _work_dtype(q, k, v)
    qw, kw, vw, g, beta, init = _prepare(
        q, k, v, g, beta, scale, initial_state, state_v_first, use_qk_l2norm_in_kernel,
        kwargs.get("use_gate_in_kernel", False), kwargs.get("A_log"), kwargs.get("dt_bias"),
        use_beta_sigmoid_in_kernel, allow_neg_eigval, work)
    B, T, HV = vw.shape[:3]
    K, V = kw.shape[-1], vw.shape[-1]

    if cu_seqlens is None:
        pad = (-T) % C
        if pad:  # trailing padding: no write, no decay
            qw, kw, vw = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (qw, kw, vw))
            g, beta = F.pad(g, (0, 0, 0, pad)), F.pad(beta, (0, 0, 0, pad))
        o, ends = _scan_chunks(qw, kw, vw, g, beta, {0: init} if init is not None else {}, C)
        o = o[:, :T]
        final = (ends[-1] if ends else (init if init is not None else vw.new_zeros(B, HV, K, V)))
        finals = final if output_final_state else None
    else:
        bounds = [int(x) for x in (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()]
        N = len(bounds) - 1
        # each sequence padded to whole chunks; index T of the source is an appended zero row
        src, dst, first, last = [], [], [], []
        at = 0
        for i in range(N):
            length = bounds[i + 1] - bounds[i]
            padded = -(-length // C) * C
            src += list(range(bounds[i], bounds[i + 1])) + [T] * (padded - length)
            dst += list(range(at, at + length))
            first.append(at // C if length else None)
            last.append((at + padded) // C - 1 if length else None)
            at += padded
        src_t = torch.tensor(src, dtype=torch.long, device=vw.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=vw.device)

        def packed(t):
            return torch.cat([t, t.new_zeros(1, 1, *t.shape[2:])], 1).index_select(1, src_t)

        starts = {}
        for i in range(N):
            if first[i] is not None:
                starts[first[i]] = (init[i:i + 1] if init is not None else vw.new_zeros(1, HV, K, V))
        o, ends = _scan_chunks(packed(qw), packed(kw), packed(vw), packed(g), packed(beta), starts, C)
        o = o.index_select(1, dst_t)
        finals = None
        if output_final_state:
            rows = []
            for i in range(N):
                if last[i] is not None:
                    rows.append(ends[last[i]][0])
                else:  # an empty sequence keeps its initial state
                    rows.append(init[i] if init is not None else vw.new_zeros(HV, K, V))
            finals = torch.stack(rows) if rows else vw.new_zeros(0, HV, K, V)
    if finals is not None and state_v_first:
        finals = finals.transpose(-1, -2)
    return o.to(q.dtype), finals


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
                                     gk: torch.Tensor | None = None, gv: torch.Tensor | None = None,
                                     beta: torch.Tensor | None = None, scale: float | None = None,
                                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                                     A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                                     use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                                     state_v_first: bool = False, cu_seqlens: torch.LongTensor | None = None,
                                     **kwargs):
    """fla's token-by-token gated delta rule (see the module docstring); also the per-key / per-value
    decays gk (B, T, HV, K), gv (B, T, HV, V) and a per-value beta (B, T, HV, V). Unlike fla's kernel
    (forward only) it has a backward through autograd."""
    state_v_first = state_v_first or bool(kwargs.get("transpose_state_layout", False))
    _check_varlen(q, initial_state, cu_seqlens)
    if use_gate_in_kernel and g is None:
        raise ValueError("`g` (raw pre-activation) must be provided when `use_gate_in_kernel=True`.")
    work = _work_dtype(q, k, v)
    if beta is None:
        beta = torch.ones_like(v[..., 0])
    qw, kw, vw, g, beta, init = _prepare(
        q, k, v, g, beta, scale, initial_state, state_v_first, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, work)
    gk = gk.to(work) if gk is not None else None
    gv = gv.to(work) if gv is not None else None
    B, T, HV = vw.shape[:3]
    K, V = kw.shape[-1], vw.shape[-1]
    if beta.dim() == 3:
        beta = beta[..., None]  # (B, T, HV, 1): one beta per head

    def run(lo, hi, S):  # tokens lo..hi-1 of every row, from state S (rows, HV, K, V)
        outs = []
        for t in range(lo, hi):
            if g is not None:
                S = S * g[:, t].exp()[..., None, None]
            if gk is not None:
                S = S * gk[:, t].exp()[..., :, None]
            if gv is not None:
                S = S * gv[:, t].exp()[..., None, :]
            k_t = kw[:, t]
            delta = beta[:, t] * (vw[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t))
            S = S + k_t[..., :, None] * delta[..., None, :]
            outs.append(torch.einsum("bhkv,bhk->bhv", S, qw[:, t]))
        return outs, S

    def zeros(rows):
        return vw.new_zeros(rows, HV, K, V)

    if cu_seqlens is None:
        outs, S = run(0, T, init if init is not None else zeros(B))
        o = torch.stack(outs, 1) if outs else vw.new_zeros(B, 0, HV, V)
        finals = S
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        outs, rows = [], []
        for i in range(len(bounds) - 1):
            seq_outs, S = run(bounds[i], bounds[i + 1], init[i:i + 1] if init is not None else zeros(1))
            outs += seq_outs
            rows.append(S[0])
        o = torch.stack(outs, 1) if outs else vw.new_zeros(1, 0, HV, V)
        finals = torch.stack(rows) if rows else zeros(0)
    if not output_final_state:
        finals = None
    elif state_v_first:
        finals = finals.transpose(-1, -2)
    return o.to(v.dtype), finals


chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule
