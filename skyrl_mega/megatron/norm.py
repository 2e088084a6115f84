"""RMSNorm for the local (non-TE) layer spec that works with sequence parallel.

In: hidden states [s, b, h] (sequence-split under SP). Out: normalised states, same shape.
Megatron's torch norm asserts SP off; this one tags its weight `sequence_parallel` so the
TP-group gradient all-reduce in megatron's DDP covers it, as TE's norm does.
"""

from __future__ import annotations

import torch


class SequenceParallelRMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float | None = None, **_):
        """eps None: the config's layernorm_epsilon (megatron-core 0.16's MambaLayer passes none)."""
        super().__init__()
        self.config = config
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device="cpu" if config.use_cpu_initialization else None)
        )
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
