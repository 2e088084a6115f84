"""The local decoder spec of Qwen3.5-MoE: Gated DeltaNet and gated full attention, an MoE in
every layer, built from megatron-core's own modules (no transformer-engine). Read against
megatron-core 0.16.1 and 0.19.2, whose builder for this stack
(experimental_attention_variant_module_specs) asserts transformer-engine.

In:  megatron TransformerConfig with `linear_attention_freq` as a list (1: GDN layer, 0: full
     attention), the linear_* sizes, attention_output_gate, qk_layernorm and
     layernorm_zero_centered_gamma; the virtual pipeline stage; routing_replay.
Out: the decoder block spec (TransformerBlockSubmodules) of this pipeline stage's layers:
  GDN   TransformerLayer(input_layernorm = SequenceParallelRMSNorm, self_attention =
        megatron's GatedDeltaNet (gated_delta_net.gdn_class(): with packed sequences on every
        version) with ColumnParallelLinear in_proj, RowParallelLinear out_proj and an uncentred
        out_norm (Qwen3.5's gated norm keeps a plain weight), the MoE MLP)
  full  the local GPT layer (local.py): q / k norms, SDPA core attention (THD packed), the
        output gate from the config, the MoE MLP (shared expert with its gate from the config)
and the final norm; with routing_replay every router is the R3 router.
"""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from ..gated_delta_net import gdn_class
from ..norm import SequenceParallelRMSNorm
from .common import submodules_of, use_r3_router
from .local import NORM, _local_layer

UNCENTRED_NORM = ModuleSpec(module=SequenceParallelRMSNorm, params={"zero_centered": False})


def linear_attention_pattern(config) -> list[int]:
    freq = config.linear_attention_freq
    if not isinstance(freq, list) or len(freq) != config.num_layers:
        raise ValueError(f"linear_attention_freq must list 1 (GDN) / 0 (attention) for each of the "
                         f"{config.num_layers} layers, got {freq!r}")
    return freq


def decoder_block_spec(config, vp_stage=None, routing_replay: bool = False):
    import copy

    gdn = gdn_class()  # first: megatron's GPT specs import its GDN module, which binds fla's kernels
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pattern = linear_attention_pattern(config)
    attention_layer = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                               qk_layernorm=config.qk_layernorm)
    _local_layer(attention_layer)
    gdn_layer = copy.deepcopy(attention_layer)
    submodules_of(gdn_layer).self_attention = ModuleSpec(
        module=gdn, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=UNCENTRED_NORM, out_proj=RowParallelLinear))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    layers = [gdn_layer if pattern[i] else attention_layer for i in range(offset, offset + count)]
    block = TransformerBlockSubmodules(layer_specs=layers, layer_norm=NORM)
    if routing_replay:
        use_r3_router(block)
    return block
