"""Causal depthwise conv1d in plain PyTorch: the CPU stand-in for the causal_conv1d package's
`causal_conv1d_fn` (whole sequences) and `causal_conv1d_update` (one decode step).

In:  causal_conv1d_fn: x (b, d, l), weight (d, w), optional bias (d,), seq_idx (b, l) (packed
     sequences: no tap reaches across a sequence start), initial_states (b, d, w - 1),
     activation None | "silu" | "swish".
     causal_conv1d_update: x (b, d), conv_state (b, d, w) (updated in place), weight, bias.
Out: the convolved (and activated) tensor, x's shape and dtype; causal_conv1d_fn with
     return_final_states also the last w - 1 inputs of each row (b, d, w - 1).

Also causal-conv1d's `cpp_functions` API (1.5+), which mamba-ssm's fused Triton path
(`mamba_split_conv1d_scan_combined`) calls directly: `causal_conv1d_fwd_function` and
`causal_conv1d_bwd_function` (the backward by autograd through causal_conv1d_fn, in fp32), so
that path runs with packed sequences where mamba-ssm's Triton kernels are real and the
causal-conv1d CUDA build is absent.

    out[:, c, t] = bias[c] + sum_k weight[c, k] * x[:, c, t - (w - 1) + k]
with x = 0 before the start (or initial_states) and across a sequence boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activate(y, activation):
    if activation in ("silu", "swish"):
        return F.silu(y)
    if activation is not None:
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    return y


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    b, d, l = x.shape
    w = weight.shape[-1]
    if seq_idx is not None and initial_states is not None:
        raise ValueError("causal_conv1d_fn takes seq_idx or initial_states, not both")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xw = x.to(work)
    left = (initial_states.to(work) if initial_states is not None
            else torch.zeros(b, d, w - 1, dtype=work, device=x.device))
    full = torch.cat([left, xw], -1)  # (b, d, w - 1 + l)
    y = torch.zeros(b, d, l, dtype=work, device=x.device)
    for k in range(w):
        shift = w - 1 - k  # tap k reads x[t - shift]
        tap = full[:, :, k: k + l]
        if seq_idx is not None and shift:
            src = F.pad(seq_idx, (shift, 0), value=-1)[:, :l]  # sequence of x[t - shift]
            tap = tap * (src == seq_idx)[:, None, :]
        y = y + weight[:, k].to(work)[None, :, None] * tap
    if bias is not None:
        y = y + bias.to(work)[None, :, None]
    y = _activate(y, activation).to(x.dtype)
    if not return_final_states:
        return y
    last = full[:, :, -(w - 1):].to(x.dtype) if w > 1 else full[:, :, :0].to(x.dtype)
    if final_states_out is not None:
        final_states_out.copy_(last)
        last = final_states_out
    return y, last


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    if cache_seqlens is not None or conv_state_indices is not None:
        raise NotImplementedError("the CPU conv1d update keeps one state per row (no cache indices)")
    squeeze = x.dim() == 2
    xs = x[:, :, None] if squeeze else x  # (b, d, steps)
    outs = []
    for t in range(xs.shape[-1]):
        conv_state.copy_(torch.cat([conv_state[:, :, 1:], xs[:, :, t: t + 1].to(conv_state.dtype)], -1))
        y = (conv_state.to(torch.float32) * weight.to(torch.float32)[None]).sum(-1)
        if bias is not None:
            y = y + bias.to(torch.float32)
        outs.append(_activate(y, activation).to(x.dtype))
    y = torch.stack(outs, -1)
    return y[:, :, 0] if squeeze else y


def causal_conv1d_fwd_function(x, weight, bias, seq_idx, initial_states, final_states_out, silu_activation):
    """causal_conv1d.cpp_functions.causal_conv1d_fwd_function: the convolved x (x's layout)."""
    act = "silu" if silu_activation else None
    if final_states_out is None:
        return causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, activation=act)
    return causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, True, final_states_out, act)[0]


def causal_conv1d_bwd_function(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx,
                               return_dinitial_states, silu_activation):
    """causal_conv1d.cpp_functions.causal_conv1d_bwd_function: (dx, dweight, dbias, dinitial_states);
    dx written into the given tensor when one is passed (mamba-ssm hands a strided view)."""
    if dfinal_states is not None:
        raise NotImplementedError("the conv1d stand-in's backward takes no gradient of the final states")
    act = "silu" if silu_activation else None
    with torch.enable_grad():
        leaves = [t.detach().float().requires_grad_(True) if t is not None else None
                  for t in (x, weight, bias, initial_states if return_dinitial_states else None)]
        xs, ws, bs, init = leaves
        init = init if init is not None else initial_states
        y = causal_conv1d_fn(xs, ws, bs, seq_idx, init, activation=act)
        grads = torch.autograd.grad(y, [t for t in leaves if t is not None], dout.float())
    it = iter(grads)
    dxs, dw = next(it), next(it)
    db = next(it) if bias is not None else None
    dinit = next(it).to(x.dtype) if return_dinitial_states else None
    if dx is None:
        dx = dxs.to(x.dtype)
    else:
        dx.copy_(dxs)
    return dx, dw.to(weight.dtype), db.to(bias.dtype) if db is not None else None, dinit


def causal_conv1d_update_function(x, conv_state, weight, bias, silu_activation, cache_seqlens, conv_state_indices):
    """causal_conv1d.cpp_functions.causal_conv1d_update_function (one decode step)."""
    return causal_conv1d_update(x, conv_state, weight, bias, "silu" if silu_activation else None,
                                cache_seqlens, conv_state_indices)


def causal_conv1d_varlen_states(x, cu_seqlens, state_len):
    """The conv state each packed sequence leaves: its last `state_len` inputs, zeros before its
    start (causal_conv1d's varlen helper). In: x (total, d), cu_seqlens (batch + 1). Out: (batch, state_len, d)
    viewed as (batch, d, state_len) like the package's."""
    starts, ends = cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()
    out = torch.zeros(len(starts), state_len, x.shape[-1], dtype=x.dtype, device=x.device)
    for i, (s, e) in enumerate(zip(starts, ends)):
        k = min(state_len, e - s)
        if k:
            out[i, state_len - k:] = x[e - k: e]
    return out.transpose(1, 2)
