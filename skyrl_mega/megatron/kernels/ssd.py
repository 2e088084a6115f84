"""Mamba2's chunked selective scan (SSD) in plain PyTorch: the CPU stand-ins for mamba_ssm's
`mamba_chunk_scan_combined`, `mamba_split_conv1d_scan_combined` (the fused mixer after in_proj)
and `selective_state_update` (one decode step), same arguments and layouts.

In:  x (b, l, h, p), dt (b, l, h), A (h,), B and C (b, l, g, n) with h a multiple of g, optional
     D (h,) or (h, p), z (b, l, h, p), dt_bias (h,), initial_states (b, h, p, n) and seq_idx
     (b, l) (packed sequences: the state restarts where seq_idx changes).
Out: y (b, l, h, p) in x's dtype, and with return_final_states the state after the last
     position (b, h, p, n).

Per head, with dt' = softplus(dt + dt_bias) when asked, clamped to dt_limit:
    S_t = exp(dt'_t A) S_{t-1} + dt'_t x_t B_t^T        y_t = S_t C_t + D x_t   (then * silu(z_t))
computed a chunk at a time (the SSD form): inside a chunk the outputs come from one masked
decay matrix; between chunks one state is carried, so the work is O(l * chunk) and autograd
gives the backward. Math in float32 (float64 inputs stay float64).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    if cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError("the CPU SSD scan takes packed sequences as seq_idx, not cu_seqlens")
    b, l, h, p = x.shape
    g, n = B.shape[-2], B.shape[-1]
    if h % g:
        raise ValueError(f"{h} heads do not divide into {g} groups")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    dt = dt.to(work)
    if dt_bias is not None:
        dt = dt + dt_bias.to(work)
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    rep = h // g
    Bh = B.to(work).repeat_interleave(rep, dim=2)  # (b, l, h, n)
    Ch = C.to(work).repeat_interleave(rep, dim=2)
    xw = x.to(work)
    seq = seq_idx if seq_idx is not None else torch.zeros(b, l, dtype=torch.int32, device=x.device)

    q = int(chunk_size)
    nc = math.ceil(l / q)
    pad = nc * q - l
    if pad:  # padded positions carry nothing (dt = 0, x = 0) and keep the last sequence
        xw, dt, Bh, Ch = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (xw, dt, Bh, Ch))
        seq = torch.cat([seq, seq[:, -1:].expand(b, pad)], 1)

    def chunks(t):
        return t.reshape(b, nc, q, *t.shape[2:])

    xc, dtc, Bc, Cc, sc = chunks(xw), chunks(dt), chunks(Bh), chunks(Ch), chunks(seq)
    la = dtc * A.to(work)  # (b, c, q, h): log decay of each step
    cum = la.cumsum(2)
    # inside a chunk: y_t += sum_{s<=t, same sequence} exp(cum_t - cum_s) (C_t . B_s) dt_s x_s
    same = sc[:, :, :, None] == sc[:, :, None, :]  # (b, c, t, s)
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    mask = (same & causal)[..., None]  # (b, c, t, s, 1)
    diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # (b, c, t, s, h)
    decay = torch.exp(torch.where(mask, diff, torch.full_like(diff, -torch.inf)))
    cb = torch.einsum("bctgn,bcsgn->bctsg", Cc, Bc)  # per head (g here = h after the repeat)
    xdt = xc * dtc[..., None]  # (b, c, q, h, p)
    y = torch.einsum("bctsh,bcshp->bcthp", decay * cb, xdt)

    # each chunk's own contribution to the state at its end (same sequence as the end only)
    end_seq = sc[:, :, -1]  # (b, c)
    to_end = torch.exp(cum[:, :, -1:, :] - cum) * (sc == end_seq[..., None])[..., None]  # (b, c, q, h)
    local = torch.einsum("bcsh,bcshp,bcshn->bchpn", to_end, xdt, Bc)
    # the state entering each chunk, chunk after chunk; a sequence start inside a chunk drops it
    state = (initial_states.to(work) if initial_states is not None
             else torch.zeros(b, h, p, n, dtype=work, device=x.device))
    prev_seq = seq[:, 0]  # the initial state belongs to the first sequence
    ys = []
    for c in range(nc):
        live = (sc[:, c] == prev_seq[:, None])[..., None]  # (b, q, 1): no restart since the chunk began
        carry = torch.exp(cum[:, c]) * live  # (b, q, h)
        ys.append(torch.einsum("bth,bthn,bhpn->bthp", carry, Cc[:, c], state))
        keep = (end_seq[:, c] == prev_seq).to(work)[:, None, None, None]
        state = keep * torch.exp(cum[:, c, -1])[:, :, None, None] * state + local[:, c]
        prev_seq = end_seq[:, c]
    y = y + torch.stack(ys, 1)
    y = y.reshape(b, nc * q, h, p)[:, :l]
    xw = xw[:, :l]
    if D is not None:
        Dw = D.to(work)
        y = y + xw * (Dw[:, None] if Dw.dim() == 1 else Dw)
    if z is not None:
        y = y * F.silu(z.to(work))
    y = y.to(x.dtype)
    return (y, state.to(x.dtype)) if return_final_states else y


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    """The whole Mamba2 mixer after in_proj, as mamba_ssm's fused kernel: zxbcdt (b, l, [z | xBC | dt])
    -> causal conv1d + SiLU on xBC -> the scan (dt through softplus) -> the gate (silu(z), or the
    gated RMSNorm when rmsnorm_weight is given) -> out_proj when given. Out: (b, l, d) [, state]."""
    from .conv1d import causal_conv1d_fn
    from .gated_rmsnorm import gated_rmsnorm

    if activation not in ("silu", "swish"):
        raise ValueError(f"activation must be 'silu' or 'swish', got {activation!r}")
    h = A.shape[0]
    p = headdim if D.dim() == 1 else D.shape[-1]
    dim = h * p
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    extra = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - h) // 2
    if extra:
        raise NotImplementedError("the CPU stand-in takes zxbcdt without a non-SSM part")
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, h], dim=-1)
    xbc = causal_conv1d_fn(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                           activation=activation).transpose(1, 2)
    x, B, C = torch.split(xbc, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    b, l = x.shape[:2]
    out = mamba_chunk_scan_combined(x.reshape(b, l, h, p), dt, A, B.reshape(b, l, ngroups, dstate),
                                    C.reshape(b, l, ngroups, dstate), chunk_size, D=D,
                                    z=None if rmsnorm_weight is not None else z.reshape(b, l, h, p),
                                    dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx,
                                    dt_softplus=True, dt_limit=dt_limit, return_final_states=return_final_states)
    y, state = out if return_final_states else (out, None)
    y = y.reshape(b, l, dim)
    if rmsnorm_weight is not None:
        y = gated_rmsnorm(y, rmsnorm_weight, z, eps=rmsnorm_eps, group_size=dim // ngroups,
                          norm_before_gate=norm_before_gate)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, state) if return_final_states else y


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    """One decode step of the recurrence, updating `state` (b, h, p, n) in place, as mamba_ssm's
    kernel: x and dt (b, h, p), A (h, p, n), B and C (b, g, n), D and dt_bias (h, p), z (b, h, p).
    Out: y (b, h, p)."""
    if state_batch_indices is not None:
        raise NotImplementedError("the CPU stand-in keeps one state per row (no batch indices)")
    work = torch.float64 if state.dtype == torch.float64 else torch.float32
    rep = x.shape[1] // B.shape[1]
    Bh = B.to(work).repeat_interleave(rep, 1)[:, :, None, :]  # (b, h, 1, n)
    Ch = C.to(work).repeat_interleave(rep, 1)[:, :, None, :]
    d = dt.to(work) + (dt_bias.to(work) if dt_bias is not None else 0)
    if dt_softplus:
        d = F.softplus(d)
    new = state.to(work) * torch.exp(d[..., None] * A.to(work)) + (d * x.to(work))[..., None] * Bh
    state.copy_(new.to(state.dtype))
    y = (new * Ch).sum(-1)
    if D is not None:
        y = y + x.to(work) * D.to(work)
    if z is not None:
        y = y * F.silu(z.to(work))
    return y.to(x.dtype)
