"""mbridge shims: make an mbridge bridge build skyrl's layer spec, and load / export the local one.

In:  an mbridge bridge class; mix `LocalSpecMixin` in before it (bridges/qwen3_moe.py does).
     Instance attributes set by bridges/interface.py: `layer_spec_choice` ('te' | 'local' | 'fast'),
     `family` (HF model_type), `routing_replay`.
Out: the bridge builds `skyrl_mega.megatron.specs.layer_spec(...)` (mbridge 0.15.1 always builds
     megatron's TE spec), and with the local or fast spec it maps local parameter names to the TE-style
     names mbridge's HF mappings are keyed on:
       decoder.layers.N.input_layernorm.weight
           -> decoder.layers.N.self_attention.linear_qkv.layer_norm_weight
       decoder.layers.N.mlp.experts.local_experts.E.linear_fcK.weight
           -> decoder.layers.N.mlp.experts.linear_fcK.weightE   (E global when EP is considered)
Each shim acts only where its guard holds (`SHIMS`) and is recorded in `skyrl_mega.compat.applied()`;
where a guard does not hold, mbridge's own method runs.
"""

from __future__ import annotations

import re

from .guard import Shim, mark_applied

_READ = "0.15.1 (installed: LLMBridge._get_transformer_layer_spec hard-codes use_transformer_engine=True)"
SHIMS = (
    Shim("mbridge", "layer_spec", "mbridge", ">=0.15.1", _READ,
         "mbridge builds only megatron's TE layer spec; skyrl's spec (local on CPU, the R3 router) "
         "comes from skyrl_mega.megatron.specs", "tests/test_megatron_parity.py::test_layer_spec_modules"),
    Shim("mbridge", "local_param_names", "mbridge", ">=0.15.1", _READ,
         "mbridge's HF name mappings are keyed on TE parameter names; the local spec's norm and "
         "per-expert names are translated to them",
         "tests/test_megatron_parity.py::test_hf_export_round_trip_is_bit_exact", "the local spec"),
)
_SPEC, _NAMES = SHIMS
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


class LocalSpecMixin:
    """Mix in before an mbridge bridge class (see module docstring)."""

    layer_spec_choice: str = "local"
    family: str = ""
    routing_replay: bool = False

    def _get_transformer_layer_spec(self, vp_stage=None):
        if not _SPEC.needed_here():
            return super()._get_transformer_layer_spec(vp_stage)
        from skyrl_mega.megatron.specs import layer_spec

        self.has_vp_stage = True  # megatron-core >= 0.16 takes vp_stage (mbridge sets this in its own)
        mark_applied(_SPEC)
        return layer_spec(self.config, self.family, self.layer_spec_choice, vp_stage=vp_stage,
                          routing_replay=self.routing_replay)

    def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep: bool = True):
        if self.layer_spec_choice == "te" or not _NAMES.needed_here():
            return super()._weight_name_mapping_mcore_local_to_global(model, consider_ep)
        mark_applied(_NAMES)
        mapping = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
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
