"""The fast layer spec: the local spec with grouped-GEMM experts and varlen flash attention.

In:  a built local spec of any family (local.py, gdn_local.py, hybrid_local.py).
Out: the same spec with megatron's SequentialMLP experts replaced by GroupedGemmExperts
     (experts.py: one grouped GEMM per linear) and SdpaDotProductAttention by
     VarlenDotProductAttention (attention.py: one varlen flash call per packed row). Both keep
     the local spec's parameters and fall back to its math where their kernels do not run, so
     bridges, checkpoints and weight sync are the local spec's, and the megatron config is
     specs.LOCAL_CONFIG too (megatron's own grouped-GEMM experts stay off).
"""

from __future__ import annotations

from megatron.core.transformer.moe.experts import SequentialMLP

from ..attention import SdpaDotProductAttention, VarlenDotProductAttention
from ..experts import GroupedGemmExperts
from .common import swap_modules

FAST_MODULES = {SequentialMLP: GroupedGemmExperts, SdpaDotProductAttention: VarlenDotProductAttention}


def use_fast_modules(spec):
    """`spec` (edited in place where it can be) with the fast modules in their slots."""
    return swap_modules(spec, FAST_MODULES)[0]
