"""RMSNorm with a SiLU gate, in plain PyTorch: the CPU stand-in for mamba_ssm's gated RMSNorm
(`mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn`), the norm of Mamba2's output.

In:  x and z (..., d), weight (d,), eps, group_size (d is normalised in groups of this many
     channels; None: all of d), norm_before_gate.
Out: norm_before_gate=False (Mamba2's): rmsnorm(x * silu(z)) * weight;
     norm_before_gate=True: rmsnorm(x) * weight * silu(z). Math in float32, x's dtype out.
`RMSNorm` is the module around it (the stand-in for mamba_ssm's layernorm_gated.RMSNorm,
whose constructor and forward(x, z=None) it keeps).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def gated_rmsnorm(x, weight, z=None, eps=1e-5, group_size=None, norm_before_gate=False):
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(work)
    gate = F.silu(z.to(work)) if z is not None else None
    if gate is not None and not norm_before_gate:
        h = h * gate
    d = h.shape[-1]
    gs = group_size or d
    if d % gs:
        raise ValueError(f"group size {gs} does not divide {d} channels")
    hg = h.reshape(*h.shape[:-1], d // gs, gs)
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    y = hg.reshape(h.shape) * weight.to(work)
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        return gated_rmsnorm(x, self.weight, z, eps=self.eps, group_size=self.group_size,
                             norm_before_gate=self.norm_before_gate)
