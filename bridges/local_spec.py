"""Local-spec support for mbridge bridges (used when transformer-engine is absent).

In: an mbridge bridge class (written for TE layer specs). Out: the same bridge building
megatron-core's local spec with a sequence-parallel RMSNorm, and translating local-spec
parameter names to the TE-style names that mbridge's HF mappings are keyed on:
  decoder.layers.N.input_layernorm.weight
      -> decoder.layers.N.self_attention.linear_qkv.layer_norm_weight
  decoder.layers.N.mlp.experts.local_experts.E.linear_fcK.weight
      -> decoder.layers.N.mlp.experts.linear_fcK.weightE   (E global when EP is considered)
"""

from __future__ import annotations

import re

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from skyrl_mega.megatron.norm import SequenceParallelRMSNorm

_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_NORM = ModuleSpec(module=SequenceParallelRMSNorm)


def _swap_norms(spec) -> None:
    """Replaces every layer-norm slot of a local layer spec with the SP-aware RMSNorm."""
    sub = spec.submodules
    for slot in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, slot, None) is not None and not _is_identity(getattr(sub, slot)):
            setattr(sub, slot, _NORM)
    attn = sub.self_attention.submodules
    for slot in ("q_layernorm", "k_layernorm"):
        if not _is_identity(getattr(attn, slot)):
            setattr(attn, slot, _NORM)


def _is_identity(x) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return x is IdentityOp or getattr(x, "module", None) is IdentityOp


class LocalSpecMixin:
    """Mix in before an mbridge bridge class; set `use_te = False` to build the local spec."""

    use_te: bool = False

    def _get_transformer_layer_spec(self, vp_stage=None):
        if self.use_te:
            return super()._get_transformer_layer_spec(vp_stage)
        block = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)
        for layer_spec in block.layer_specs:
            _swap_norms(layer_spec)
        block.layer_norm = _NORM
        self.has_vp_stage = True
        return block

    def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep: bool = True):
        mapping = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
        if self.use_te:
            return super()._weight_name_mapping_mcore_local_to_global(model, consider_ep)
        per_rank = self.config.num_moe_experts // self.mpu.ep_size if self.config.num_moe_experts else 0
        offset = per_rank * self.mpu.ep_rank if consider_ep else 0
        out = {}
        for local, name in mapping.items():
            m = _LOCAL_EXPERT.search(name)
            if m:
                name = name[: m.start()] + f".mlp.experts.{m.group(2)}.weight{int(m.group(1)) + offset}"
            elif name.endswith(".input_layernorm.weight"):
                name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
            out[local] = name
        return out
