"""Grouped GEMM for MoE experts: torch's grouped matrix multiply, and where it runs.

In:  x [T, K], rows sorted by group; w [G, N, K] (one weight per group, megatron's [out, in]
     layout); `offs` int32 [G], the cumulative group sizes (offs[-1] = T) on x's device.
Out: `grouped_linear(x, w, offs)`: [T, N], rows of group g = x_g @ w_g^T, with autograd (torch's
     own backward of the grouped op); `grouped_mm_runs(x, w)`: whether torch runs that product
     here, so callers keep their per-group loop where it does not.

torch names the op `torch.nn.functional.grouped_mm` in newer releases and `torch._grouped_mm`
(2.8 on) before; both take the same arguments. It needs rows 16-byte aligned (K and N times the
element size a multiple of 16) and a dtype the device's kernel takes (bf16 / fp16 CUDA kernels on
sm90; float32 on CPU), which `grouped_mm_runs` checks once per (device type, dtype) by running
the op and its backward on a small aligned problem.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_OP = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _OP(x, w.transpose(1, 2), offs=offs)


@functools.lru_cache(maxsize=None)
def _runs_on(device_type: str, device_index: int | None, dtype: torch.dtype) -> bool:
    if _OP is None:
        return False
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:
        with torch.enable_grad():  # the first call may come from a no-grad forward
            return _probe(device, dtype)
    except (RuntimeError, NotImplementedError):
        return False


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """The op and its backward on a small aligned problem with an empty group, checked."""
    x = torch.randn(24, 16, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(3, 16, 16, device=device, dtype=dtype, requires_grad=True)
    offs = torch.tensor([8, 8, 24], device=device, dtype=torch.int32)
    y = grouped_linear(x, w, offs)
    y.backward(torch.ones_like(y))
    ref = torch.cat([x[:8] @ w[0].T, x[8:] @ w[2].T]).float()
    return bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-1))


def grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when torch's grouped GEMM takes x [T, K] and w [G, N, K] here (dtype, device, alignment)."""
    size = x.element_size()
    if x.dtype != w.dtype or (w.shape[-1] * size) % 16 or (w.shape[-2] * size) % 16:
        return False
    return _runs_on(x.device.type, x.device.index, x.dtype)
