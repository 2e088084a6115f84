"""RMSNorm for the local (non-TE) layer spec that works with sequence parallel.

In: hidden states [s, b, h] (sequence-split under SP). Out: normalised states, same shape.
Megatron's torch norm asserts SP off; this one tags its weight `sequence_parallel` so the
TP-group gradient all-reduce in megatron's DDP covers it, as TE's norm does.
Zero-centred gamma (the config's `layernorm_zero_centered_gamma`, Qwen3.5's norms): the weight
starts at 0 and the norm scales by (1 + weight), the HF checkpoint's own convention, so weights
copy across unchanged. A spec entry can pin `zero_centered` (Qwen3.5's gated GDN output norm
keeps a plain weight while every other norm of that model is zero-centred).
`FusedRMSNorm`, the fast spec's, computes the same formula as one fused kernel on CUDA
(kernels/fused.py).
"""

from __future__ import annotations

import torch

from .kernels import fused


class SequenceParallelRMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float | None = None, zero_centered: bool | None = None, **_):
        """eps None: the config's layernorm_epsilon (megatron-core 0.16's MambaLayer passes none);
        zero_centered None: the config's layernorm_zero_centered_gamma."""
        super().__init__()
        self.config = config
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.zero_centered = bool(config.layernorm_zero_centered_gamma if zero_centered is None else zero_centered)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(
            init(hidden_size, dtype=config.params_dtype, device="cpu" if config.use_cpu_initialization else None)
        )
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:  # HF Qwen3.5: (x * (1 + w)) in float32, then the input dtype
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


class FusedRMSNorm(SequenceParallelRMSNorm):
    """The same norm as one fused kernel where kernels/fused.py fuses (the fast spec's norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps, self.zero_centered)
