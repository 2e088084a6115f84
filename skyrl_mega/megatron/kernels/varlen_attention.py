"""Causal attention over THD-packed sequences in one flash-attention call (torch's varlen API).

In:  q [T, Hq, D], k / v [T, Hkv, D] (Hq a multiple of Hkv), cu_seqlens int32 [N + 1] (sequence
     starts, cu[-1] = T), the longest sequence, the softmax scale (None: 1/sqrt(D)).
Out: `varlen_causal_attention(...)`: [T, Hq, D], each sequence attending causally within itself,
     with autograd (torch's flash backward); `varlen_runs(q)`: whether it runs here.

torch.nn.attention.varlen.varlen_attn is CUDA-only (flash kernels, fp16 / bf16). Its signature
changed between releases: torch 2.10 takes `is_causal`, later ones `window_size` ((-1, 0) is
causal), and only some take `enable_gqa` (without it K/V heads are repeated here). Which form is
installed is read from the signature, once, in this module.
"""

from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=None)
def _api():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


def varlen_runs(q: torch.Tensor) -> bool:
    api = _api()
    return api is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None = None):
    fn, causal, has_gqa, has_scale = _api()
    kwargs = dict(causal)
    if k.shape[1] != q.shape[1]:
        if has_gqa:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if scale is not None:
        if not has_scale:
            q = q * (scale * q.shape[-1] ** 0.5)  # the kernel scales by 1/sqrt(D)
        else:
            kwargs["scale"] = scale
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)
