"""The TE layer spec: megatron-core's transformer-engine modules (GPU).

In:  megatron TransformerConfig, virtual pipeline stage, routing_replay.
Out: megatron's GPT decoder block spec with use_transformer_engine=True (what mbridge builds),
     with the R3 router in the MoE layers when routing_replay. TEDotProductAttention takes THD
     packed sequences itself.
"""

from __future__ import annotations

from .common import use_r3_router


def decoder_block_spec(config, vp_stage=None, routing_replay: bool = False):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    if routing_replay:
        use_r3_router(block)
    return block
