"""The local layer spec: megatron-core's own modules (no transformer-engine), with skyrl's entries.

In:  megatron TransformerConfig, virtual pipeline stage, routing_replay.
Out: megatron's GPT decoder block spec with use_transformer_engine=False, where
  - every layer-norm slot (input, pre-MLP, q / k, final) is SequenceParallelRMSNorm (norm.py:
    megatron's torch norm asserts sequence parallel off),
  - the core attention is SdpaDotProductAttention (attention.py: THD packed sequences, SDPA),
  - with routing_replay, every MoE router is the R3 router (common.R3TopKRouter).
The megatron config it needs is specs.LOCAL_CONFIG.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from ..attention import SdpaDotProductAttention
from ..norm import SequenceParallelRMSNorm
from .common import module_of, submodules_of, use_r3_router

NORM = ModuleSpec(module=SequenceParallelRMSNorm)


def _is_identity(entry) -> bool:
    return module_of(entry) is IdentityOp


def _local_layer(layer) -> None:
    """Norm and core-attention entries of one layer spec (edited in place)."""
    sub = submodules_of(layer)
    for slot in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, slot, None) is not None and not _is_identity(getattr(sub, slot)):
            setattr(sub, slot, NORM)
    attn = submodules_of(sub.self_attention)
    for slot in ("q_layernorm", "k_layernorm"):
        if not _is_identity(getattr(attn, slot)):
            setattr(attn, slot, NORM)
    if module_of(attn.core_attention) is DotProductAttention:
        attn.core_attention = SdpaDotProductAttention


def decoder_block_spec(config, vp_stage=None, routing_replay: bool = False):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    for layer in block.layer_specs:
        _local_layer(layer)
    block.layer_norm = NORM
    if routing_replay:
        use_r3_router(block)
    return block
