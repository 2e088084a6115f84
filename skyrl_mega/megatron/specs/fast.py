"""The fast layer spec: the local spec with grouped-GEMM experts, varlen flash attention, and no
host syncs inside a layer.

In:  a built local spec of any family (local.py, gdn_local.py, hybrid_local.py).
Out: the same spec with
  - megatron's SequentialMLP experts replaced by GroupedGemmExperts (experts.py: one grouped
    GEMM per linear),
  - SdpaDotProductAttention by VarlenDotProductAttention (attention.py: one varlen flash call
    per packed row),
  - SelfAttention by PackedRopeSelfAttention (rope.py: THD RoPE from device-side positions),
  - MoELayer by SyncFreeMoELayer (dispatch.py: no host syncs where all experts are local),
  - SequenceParallelRMSNorm by FusedRMSNorm (norm.py), and the experts' SwiGLU and the RoPE
    as fused kernels too (kernels/fused.py, torch.compile on CUDA; model.fused_kernels).
All keep the local spec's parameters and fall back to megatron's path where theirs does not
apply, so bridges, checkpoints and weight sync are the local spec's, and the megatron config is
specs.LOCAL_CONFIG too (megatron's own grouped-GEMM experts stay off).
"""

from __future__ import annotations

import copy

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from ..attention import SdpaDotProductAttention, VarlenDotProductAttention
from ..dispatch import SyncFreeMoELayer
from ..experts import GroupedGemmExperts
from ..norm import FusedRMSNorm, SequenceParallelRMSNorm
from ..rope import PackedRopeSelfAttention
from .common import swap_modules

FAST_MODULES = {SequentialMLP: GroupedGemmExperts, SdpaDotProductAttention: VarlenDotProductAttention,
                SelfAttention: PackedRopeSelfAttention, MoELayer: SyncFreeMoELayer,
                SequenceParallelRMSNorm: FusedRMSNorm}


def use_fast_modules(spec):
    """A copy of `spec` with the fast modules in their slots (a copy: the local spec's entries,
    such as its shared norm entry, stay as they are)."""
    return swap_modules(copy.deepcopy(spec), FAST_MODULES)[0]
