"""Grouped GEMM for MoE experts: torch's grouped matrix multiply, and where it runs.

In:  x [T, K], rows sorted by group; w [G, N, K] (one weight per group, megatron's [out, in]
     layout); `offs` int32 [G], the cumulative group sizes (offs[-1] = T) on x's device.
Out: `grouped_linear(x, w, offs)`: [T, N], rows of group g = x_g @ w_g^T, with autograd (torch's
     own backward of the grouped op); `expert_linear(x, weights, offs)`: the same product over a
     list of per-expert [N, K] parameters, whose weight gradient is one grouped GEMM written
     straight into megatron's gradient buffer (`main_grad`) where the parameters have one;
     `grouped_mm_runs(x, w)`: whether torch runs that product here, so callers keep their
     per-group loop where it does not.

Why `expert_linear`: autograd through `torch.stack(weights)` hands every expert its own gradient
tensor, and megatron's gradient hook then adds each into its buffer: per linear per micro-batch
one slice copy and one add per expert (thousands of small kernels a step on a 128-expert model).
Here the [E, N, K] weight gradient lands in the buffer with one add when the experts' buffer
slices are evenly spaced (megatron lays a module's parameters out back to back) and with one
multi-tensor add otherwise; the parameters then get an empty placeholder gradient and
`grad_added_to_main_grad`, the contract megatron's own fused-accumulation linears follow.

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

from .fused import add_flipped_

_OP = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _OP(x, w.transpose(1, 2), offs=offs)


class _ExpertLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offs, *weights):
        w = torch.stack(weights)
        ctx.save_for_backward(x, offs, w)
        ctx.weights = weights
        return _OP(x, w.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, offs, w = ctx.saved_tensors
        weights, ctx.weights = ctx.weights, None
        dy = dy.contiguous()
        dx = _OP(dy, w, offs=offs) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[2:]):
            return (dx, None, *([None] * len(weights)))
        dw = _OP(dy.t(), x, offs=offs)  # [E, N, K]: dy_e^T @ x_e
        if _add_into_main_grads(weights, dw):
            return (dx, None, *(torch.empty_like(p) for p in weights))
        return (dx, None, *dw.unbind(0))


def _add_into_main_grads(weights, dw: torch.Tensor) -> bool:
    """Adds dw [E, N, K] into the parameters' `main_grad` buffers; False when they have none."""
    grads = [getattr(p, "main_grad", None) for p in weights]
    if any(g is None or not hasattr(p, "grad_added_to_main_grad") for g, p in zip(grads, weights)):
        return False
    view = _one_view(grads)
    if view is not None:  # add_ widens bf16 to the buffer's fp32 in its kernel: no extra copy
        stacked, descending = view
        if descending:
            add_flipped_(stacked, dw)
        else:
            stacked.add_(dw)
    else:
        torch._foreach_add_(grads, list(dw.to(grads[0].dtype).unbind(0)))
    for p in weights:
        p.grad_added_to_main_grad = True
    return True


def _one_view(grads):
    """grads (contiguous [N, K] slices of one buffer, evenly spaced) as one [E, N, K] view of the
    buffer, ascending in memory, and whether the list runs in descending order; else None."""
    g0 = grads[0]
    if len(grads) == 1:
        return g0[None], False
    if not all(g.is_contiguous() and g.dtype == g0.dtype and g.shape == g0.shape
               and g.untyped_storage().data_ptr() == g0.untyped_storage().data_ptr() for g in grads):
        return None
    offsets = [g.storage_offset() for g in grads]
    step = offsets[1] - offsets[0]
    if abs(step) < g0.numel() or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    base = min(offsets)
    view = g0.as_strided((len(grads), *g0.shape), (abs(step), *g0.stride()), base)
    return view, step < 0


def expert_linear(x: torch.Tensor, weights, offs: torch.Tensor) -> torch.Tensor:
    """[T, N]: rows of expert e = x_e @ weights[e]^T (see the module docstring for the backward)."""
    return _ExpertLinear.apply(x, offs, *weights)


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
