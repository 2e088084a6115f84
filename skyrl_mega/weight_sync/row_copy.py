"""Row gather as a straight copy kernel (Triton): a strided chain of equal runs into one block.

In:  dst [k, n] contiguous, src [k', n] a row-strided view of a source buffer (row stride >= n,
     either order in memory), rows [k] long: dst[i] = src[rows[i]] (CopyPlan's strided chains:
     one layer's experts from a trainer's DDP buffer, descending, into vLLM's [E, ...] block).
Out: the bytes copied on the current stream; `available(t)`: whether the kernel runs for t.

Why: torch's index_select does this copy as a gather, computing a source index for every
element; on the H200 it moved a layer's experts at 86% of a flat device-to-device copy. Here
each program copies one contiguous block of one row (the row's source offset read once), so
the loads and stores are plain wide, contiguous accesses. CopyPlan times this way against the
others once per bound plan and keeps the fastest (copy_plan.py); tests/test_copy_plan_gpu.py
checks the bytes on CUDA.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 4096  # elements a program copies (int64 elements: 32 KiB)


@functools.lru_cache(maxsize=1)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def copy_rows(src, dst, rows, src_stride, n, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        b = tl.program_id(1)
        r = tl.load(rows + i).to(tl.int64)
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src + r * src_stride + offs, mask=mask)
        tl.store(dst + i.to(tl.int64) * n + offs, x, mask=mask)

    return triton, copy_rows


def available(t: torch.Tensor) -> bool:
    return t.is_cuda and _kernel() is not None


def copy_rows(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
    """dst[i] = src[rows[i]] for dst [k, n] contiguous and src [*, n] with unit column stride."""
    if dst.dim() != 2 or src.dim() != 2 or src.stride(1) != 1 or not dst.is_contiguous() or dst.shape[1] != src.shape[1]:
        raise ValueError(f"copy_rows: dst {tuple(dst.shape)} / src {tuple(src.shape)} stride {src.stride()} "
                         "are not [k, n] contiguous / [*, n] row-strided")
    triton, kernel = _kernel()
    k, n = dst.shape
    kernel[(k, triton.cdiv(n, BLOCK))](src, dst, rows, src.stride(0), n, BLOCK=BLOCK, num_warps=8)
