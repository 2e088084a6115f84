"""MoE experts through one grouped GEMM per linear, with megatron's per-expert parameters.

In:  what megatron's token dispatcher hands SequentialMLP: the tokens routed to this rank's
     experts, sorted by expert ([T, hidden]), tokens per expert, and each token's routing prob.
Out: the experts' outputs for those tokens ([T, hidden]) and no bias, as SequentialMLP returns.

`GroupedGemmExperts` is SequentialMLP (same `local_experts.N.linear_fc{1,2}.weight` parameters,
state dict, dist-checkpoint layout, bridge names and weight-sync export) whose forward stacks the
experts' weights and runs each linear as one grouped GEMM (kernels/grouped_mm.py) instead of one
matmul per expert: fc1, the activation (gated or not, megatron's clamp and linear offset), the
routing prob (one fused kernel for SwiGLU on CUDA, kernels/fused.py), fc2 (`expert_linear`: the weight gradient is one grouped GEMM added straight into
megatron's gradient buffer). The experts' linears need no communication of their own (megatron's dispatcher
does the expert-parallel and expert-tensor-parallel exchange), so the math is per rank and equals
SequentialMLP's; the weight gradients reach every expert's gradient buffer slice.
It keeps SequentialMLP's own forward where that does something this one does not (fp8 / fp4,
expert biases, TE activations, delayed weight gradients) or where torch's grouped GEMM does not
run (dtype, device, alignment).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from .kernels.fused import swiglu_probs
from .kernels.grouped_mm import expert_linear, grouped_mm_runs


class GroupedGemmExperts(SequentialMLP):
    """SequentialMLP computed by grouped GEMM (see module docstring)."""

    def _grouped_ok(self, hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
        cfg = self.config
        plain = not (cfg.fp8 or cfg.fp4 or cfg.add_bias_linear or getattr(cfg, "use_te_activation_func", False)
                     or getattr(cfg, "delay_wgrad_compute", False))
        return plain and grouped_mm_runs(hidden, w1) and grouped_mm_runs(hidden.new_empty(0, w2.shape[-1]), w2)

    def _plain_swiglu(self) -> bool:
        cfg = self.config
        return (cfg.gated_linear_unit and cfg.activation_func is F.silu
                and getattr(cfg, "activation_func_clamp_value", None) is None and not getattr(cfg, "glu_linear_offset", 0.0))

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if not cfg.gated_linear_unit:
            return cfg.activation_func(x)
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if (clamp := getattr(cfg, "activation_func_clamp_value", None)) is not None:
            x_glu = x_glu.clamp(min=None, max=clamp)
            x_linear = x_linear.clamp(min=-clamp, max=clamp)
        return cfg.activation_func(x_glu) * (x_linear + getattr(cfg, "glu_linear_offset", 0.0))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        hidden, probs = permuted_local_hidden_states, permuted_probs
        w1 = [e.linear_fc1.weight for e in self.local_experts]
        w2 = [e.linear_fc2.weight for e in self.local_experts]
        if not self._grouped_ok(hidden, w1[0][None], w2[0][None]):
            return super().forward(hidden, tokens_per_expert, probs)
        dtype = hidden.dtype
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1")
            hidden = (probs.unsqueeze(-1) * hidden).to(dtype)
            probs = torch.ones_like(probs)
        offs = torch.as_tensor(tokens_per_expert, device=hidden.device).cumsum(0).to(torch.int32)
        inter = expert_linear(hidden, w1, offs)
        if self._plain_swiglu():
            inter = swiglu_probs(inter, probs)
        else:
            inter = (self._activation(inter) * probs.unsqueeze(-1)).to(dtype)
        return expert_linear(inter, w2, offs), None
