"""Qwen3-MoE: HF <-> Megatron names (declarative) on top of mbridge's Qwen3-MoE bridge.

Adds the dense-MLP layers (`mlp_only_layers`); skyrl's layer spec and the local-spec names come
from compat.mbridge.LocalSpecMixin, reads through checkpoint_io; the rest is mbridge's.
"""

from __future__ import annotations

from mbridge.models.qwen3moe import Qwen3MoEBridge

from skyrl_mega.compat.mbridge import LocalSpecMixin

from .checkpoint_io import ReadsEitherExpertLayout

L = "model.layers.{layer_number}"


class Qwen3MoeBridge(ReadsEitherExpertLayout, LocalSpecMixin, Qwen3MoEBridge):
    _MLP_MAPPING = {
        "pre_mlp_layernorm": [f"{L}.post_attention_layernorm.weight"],
        "mlp.linear_fc1.layer_norm_weight": [f"{L}.post_attention_layernorm.weight"],
        "mlp.router.weight": [f"{L}.mlp.gate.weight"],
        "mlp.experts.linear_fc1": [
            f"{L}.mlp.experts.{{expert_id}}.gate_proj.weight",
            f"{L}.mlp.experts.{{expert_id}}.up_proj.weight",
        ],
        "mlp.experts.linear_fc2": [f"{L}.mlp.experts.{{expert_id}}.down_proj.weight"],
        # dense layers (mlp_only_layers)
        "mlp.linear_fc1.weight": [f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": [f"{L}.mlp.down_proj.weight"],
    }

    def _build_config(self):
        hf = self.hf_config
        dense = set(getattr(hf, "mlp_only_layers", []) or [])
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        moe_layer_freq = [
            0 if (i in dense or (i + 1) % step) else 1 for i in range(hf.num_hidden_layers)
        ]
        return self._build_base_config(
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_router_topk=hf.num_experts_per_tok,
            num_moe_experts=hf.num_experts,
            moe_layer_freq=moe_layer_freq,
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not getattr(hf, "norm_topk_prob", True),
            qk_layernorm=True,
        )
