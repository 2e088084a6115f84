"""The local hybrid stack spec: megatron-core's Mamba2 / attention / MLP / MoE layers without
transformer-engine (Nemotron 3). Read against megatron-core 0.16.1 and 0.19.2.

In:  megatron TransformerConfig (with the mamba_* fields), routing_replay.
Out: a ModuleSpec for megatron's hybrid stack (MambaStack; 0.19 names it HybridStack and keeps
     MambaStack as an alias) whose layers are
  M  MambaLayer(norm=SequenceParallelRMSNorm, mixer=megatron's MambaMixer with ColumnParallelLinear
     in_proj and RowParallelLinear out_proj; its kernels: skyrl_mega/compat/mamba_ssm.py on CPU)
  *  TransformerLayer with only the attention half (input_layernorm, SdpaDotProductAttention: THD
     packed sequences; NemotronH attention has no q/k norm and no position embedding)
  -  MLPLayer (pre_mlp_layernorm, fc1 / fc2; the config's activation, squared ReLU for NemotronH)
  E  MoETransformerLayer (pre_mlp_layernorm, per-expert linears, shared experts when configured;
     with routing_replay the R3 router)
  and the stack's final norm is SequenceParallelRMSNorm too: megatron hard-codes TENorm there, so
  the stack is `LocalNormHybridStack`, a subclass that builds megatron's stack without its final
  norm and adds this one (the norm's parameter keeps megatron's name, decoder.final_norm.weight).
The unfused norms name their weights `layers.N.norm.weight` (M), `input_layernorm.weight` (*),
`pre_mlp_layernorm.weight` (- and E), where the TE spec fuses them into in_proj / linear_qkv / fc1.
"""

from __future__ import annotations

import functools

from megatron.core.transformer.spec_utils import ModuleSpec

from ..attention import SdpaDotProductAttention
from ..norm import SequenceParallelRMSNorm
from .common import use_r3_router

NORM = ModuleSpec(module=SequenceParallelRMSNorm)


@functools.lru_cache(maxsize=None)
def _stack_class():
    from megatron.core.ssm.mamba_block import MambaStack

    class LocalNormHybridStack(MambaStack):
        """megatron's hybrid stack with the local final norm instead of its hard-coded TENorm."""

        def __init__(self, config, submodules, *args, post_layer_norm: bool = True, **kwargs):
            super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = SequenceParallelRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    return LocalNormHybridStack


def hybrid_stack_spec(config, routing_replay: bool = False) -> ModuleSpec:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.mamba_block import MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=NORM,
        mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=NORM,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(
                                      linear_qkv=ColumnParallelLinear, core_attention=SdpaDotProductAttention,
                                      linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=NORM,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))
    moe = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=NORM,
        mlp=get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts or 1, moe_grouped_gemm=False),
        mlp_bda=get_bias_dropout_add))
    stack = ModuleSpec(module=_stack_class(), submodules=MambaStackSubmodules(
        mamba_layer=mamba, attention_layer=attention, mlp_layer=mlp, moe_layer=moe))
    if routing_replay:
        use_r3_router([moe])
    return stack
