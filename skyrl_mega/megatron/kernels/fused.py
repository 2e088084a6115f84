"""Elementwise chains of the fast spec as single kernels: RMSNorm, SwiGLU x routing prob, RoPE,
and the experts' reversed gradient add.

In:  the tensors of the eager formula each function states (the local spec's own math, written
     once here). Out: the same values; on CUDA, with fusion on, computed by torch.compile
     (inductor writes one Triton kernel for the forward and one for the backward of each
     chain), elsewhere by the eager formula itself.

Why: each of these chains is 5-10 elementwise kernels forward and more backward over
[tokens, hidden] tensors (in float32 for the norms), so on the GPU they cost memory traffic and
kernel launches rather than math: at hidden 2048 and 16K tokens a micro-batch, dozens of
launches a layer. Fused, each reads its inputs and writes its output once. In float32 math the
fused and eager results agree to rounding; in bf16 the fused chain rounds once at the end where
eager rounds after each op (within bf16 tolerance, checked by tests/test_fast_spec_gpu.py).

`set_fusion(mode)`: "auto" (the default: fuse on CUDA), "on" (also on CPU, for tests), "off".
Shapes are compiled as dynamic, so packed micro-batches of any length reuse one kernel.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MODES = ("auto", "on", "off")
_mode = "auto"


def set_fusion(mode: str) -> None:
    global _mode
    if mode not in MODES:
        raise ValueError(f"fusion mode {mode!r}: choose one of {', '.join(MODES)}")
    _mode = mode


def fusion_mode() -> str:
    return _mode


def _fusing(x: torch.Tensor) -> bool:
    return _mode == "on" or (_mode == "auto" and x.is_cuda)


COMPILED: set[str] = set()  # the chains compiled in this process (their eager functions' names)


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    COMPILED.add(fn.__name__)
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _run(fn, *args):
    return _compiled(fn)(*args) if _fusing(args[0]) else fn(*args)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:  # HF Qwen3.5: (x * (1 + w)) in float32, then the input dtype
        return (x32 * (1.0 + weight.float())).to(dtype)
    return weight * x32.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim, HF's convention: normalise in float32, back to x's dtype, then
    scale by weight (zero-centred: by 1 + weight, in float32)."""
    return _run(_rms_norm, x, weight, eps, zero_centered)


def _swiglu_probs(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(x, 2, dim=-1)
    return (F.silu(gate) * up * probs.unsqueeze(-1)).to(x.dtype)


def swiglu_probs(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :n]) * x[:, n:] * probs[:, None] for x [T, 2n], probs [T] (the experts' gated
    activation and routing prob), in x's dtype."""
    return _run(_swiglu_probs, x, probs)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot_dim = cos.shape[-1]
    if rot_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    head, rest = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((head * cos + _rotate_half(head) * sin, rest), dim=-1)


def _add_flipped_(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.add_(src.flip(0))


def add_flipped_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst += src reversed along dim 0 (src widened to dst's dtype), in place: the experts'
    weight gradients into megatron's buffer, which holds them in descending order. Fused, the
    reversed copy of src is never written."""
    _run(_add_flipped_, dst, src)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., dim] rotated on its first cos.shape[-1] channels, non-interleaved (megatron's
    `_apply_rotary_pos_emb_bshd` math); cos / sin broadcast against x's leading dims."""
    return _run(_rope, x, cos, sin)
