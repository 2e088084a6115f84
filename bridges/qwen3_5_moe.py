"""Qwen3.5-MoE (Gated DeltaNet + gated attention + MoE), text model: HF <-> Megatron names,
declarative, on mbridge's LLMBridge machinery (loading, TP scatter, PP / EP / TP gathers).

In:  an HF config of model_type `qwen3_5_moe_text` (text checkpoint, tensors `model.*`) or
     `qwen3_5_moe` (the multimodal checkpoint: its text_config, tensors `model.language_model.*`;
     the vision tower is neither loaded nor exported).
Out: megatron's GPTModel on the local GDN spec (megatron/specs/gdn_local.py) and the name map
     (megatron name after decoder.layers.N. -> HF names after <prefix>layers.N.):
  both   input_layernorm / pre_mlp_layernorm   <- input_layernorm / post_attention_layernorm
  GDN    self_attention.in_proj   <- linear_attn.in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
         (megatron's order q, k, v, z, beta, alpha); conv1d / A_log / dt_bias / out_proj <- the
         same names; out_norm <- linear_attn.norm
  full   self_attention.linear_qkv <- q_proj ([query | gate] per head), k_proj, v_proj, laid out
         per query group as megatron's output-gated attention reads it: [q heads, gate heads,
         k, v]; q / k_layernorm <- q_norm / k_norm; linear_proj <- o_proj
  MoE    router <- mlp.gate; experts' fc1 <- [gate_proj; up_proj], fc2 <- down_proj; the shared
         expert likewise and its sigmoid gate <- mlp.shared_expert_gate
Norms are zero-centred (HF scales by 1 + w, megatron's layernorm_zero_centered_gamma; weights
copy unchanged), except the GDN output norm. Tensor parallelism splits in_proj and conv1d part
by part. Multi-token-prediction layers (`mtp_num_hidden_layers`, tensors `mtp.*`) and the
multimodal checkpoint's vision tower (`model.visual.*`) are carried, not built: RL trains the
text model, and every HF checkpoint written from it (convert, the trainer's HF saves) holds the
source checkpoint's tensors of both unchanged (ModelBridge.carried); vLLM serves the model
without MTP unless speculative decoding is asked for, and text-only (`--language-model-only`).
"""

from __future__ import annotations

import re

import torch
from mbridge.core.llm_bridge import LLMBridge

from skyrl_mega.compat.mbridge import LocalSpecMixin

from .checkpoint_io import ReadsEitherExpertLayout
from .tp_parts import FusedPartsTP
from skyrl_mega.compat.transformers import fix_hf_config

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")
LAYER_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": ["input_layernorm.weight"],
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    # Gated DeltaNet
    "self_attention.in_proj.weight": ["linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                                      "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"],
    "self_attention.conv1d.weight": ["linear_attn.conv1d.weight"],
    "self_attention.A_log": ["linear_attn.A_log"],
    "self_attention.dt_bias": ["linear_attn.dt_bias"],
    "self_attention.out_norm.weight": ["linear_attn.norm.weight"],
    "self_attention.out_proj.weight": ["linear_attn.out_proj.weight"],
    # full attention with an output gate
    "self_attention.linear_qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"],
    "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
    "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
    "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
    # MoE
    "mlp.router.weight": ["mlp.gate.weight"],
    "mlp.shared_experts.linear_fc1.weight": ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"],
    "mlp.shared_experts.linear_fc2.weight": ["mlp.shared_expert.down_proj.weight"],
    "mlp.shared_experts.gate_weight": ["mlp.shared_expert_gate.weight"],
}
EXPERT_NAMES = {"1": ["mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"],
                "2": ["mlp.experts.{e}.down_proj.weight"]}
_GDN_VECTORS = ("self_attention.A_log", "self_attention.dt_bias")


def text_config(hf_config):
    """The text model's config (the multimodal checkpoint keeps it in text_config)."""
    return getattr(hf_config, "text_config", None) or hf_config


def unsupported(hf) -> list[str]:
    """What of this (text) config the megatron build would get wrong; each entry says why."""
    problems = []
    if getattr(hf, "attention_bias", False):
        problems.append("attention_bias=True: the megatron build has no attention biases")
    if getattr(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.hidden_act!r}: the GDN gate and experts are mapped for silu")
    kinds = set(hf.layer_types)
    if not kinds <= {"linear_attention", "full_attention"}:
        problems.append(f"layer_types {sorted(kinds)}: only linear_attention / full_attention are mapped")
    rope = getattr(hf, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope['rope_type']!r}: only default RoPE is mapped")
    if rope.get("mrope_interleaved") is False:
        problems.append("mrope_interleaved=False: only text positions (all M-RoPE sections equal) are mapped")
    return problems


class Qwen3_5MoeBridge(ReadsEitherExpertLayout, LocalSpecMixin, FusedPartsTP, LLMBridge):
    TP_VECTORS = _GDN_VECTORS
    CARRIED_PREFIXES = ("mtp.", "model.visual.")
    _CONFIG_MAPPING = {
        "num_layers": "num_hidden_layers",
        "hidden_size": "hidden_size",
        "num_attention_heads": "num_attention_heads",
        "num_query_groups": "num_key_value_heads",
        "ffn_hidden_size": "moe_intermediate_size",
        "attention_dropout": "attention_dropout",
        "hidden_dropout": ("hidden_dropout", 0.0),
        "layernorm_epsilon": "rms_norm_eps",
        "kv_channels": "head_dim",
    }

    def __init__(self, hf_config, *args, **kwargs):
        self.prefix = "model.language_model." if getattr(hf_config, "text_config", None) is not None else "model."
        super().__init__(fix_hf_config(text_config(hf_config)), *args, **kwargs)

    def _build_config(self):
        hf = self.hf_config
        problems = unsupported(hf)
        if problems:
            raise ValueError(f"Qwen3.5-MoE config not supported: {'; '.join(problems)}")
        self.linear_pattern = [1 if t == "linear_attention" else 0 for t in hf.layer_types]
        return self._build_base_config(
            # Gated DeltaNet layers
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=list(self.linear_pattern),
            linear_conv_kernel_dim=hf.linear_conv_kernel_dim,
            linear_key_head_dim=hf.linear_key_head_dim,
            linear_value_head_dim=hf.linear_value_head_dim,
            linear_num_key_heads=hf.linear_num_key_heads,
            linear_num_value_heads=hf.linear_num_value_heads,
            # full attention
            attention_output_gate=True,
            qk_layernorm=True,
            layernorm_zero_centered_gamma=True,
            # MoE in every layer: softmax router, top-k renormalised, shared expert with a gate
            num_moe_experts=hf.num_experts,
            moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
            moe_shared_expert_gate=True,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=False,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )

    @property
    def moe_layer_numbers(self) -> list[int]:
        return list(range(self.hf_config.num_hidden_layers))

    def _get_gptmodel_args(self) -> dict:
        rope = getattr(self.hf_config, "rope_parameters", None) or {}
        return {**super()._get_gptmodel_args(), "rotary_percent": rope.get("partial_rotary_factor", 1.0)}

    # ---------------------------------------------------------------- names
    def _weight_name_mapping_mcore_to_hf(self, name: str) -> list[str]:
        p = self.prefix
        direct = {"embedding.word_embeddings.weight": p + "embed_tokens.weight",
                  "decoder.final_layernorm.weight": p + "norm.weight", "output_layer.weight": "lm_head.weight"}
        if name in direct:
            return [direct[name]]
        m = _LAYER.match(name)
        if m:
            n, rest = m.groups()
            layer = f"{p}layers.{n}."
            e = _EXPERT.match(rest)
            if e:
                return [layer + h.format(e=e.group(2)) for h in EXPERT_NAMES[e.group(1)]]
            if rest in LAYER_NAMES:
                return [layer + h for h in LAYER_NAMES[rest]]
        raise NotImplementedError(f"Qwen3.5-MoE bridge: no HF name for megatron parameter {name}")

    # ---------------------------------------------------------------- tensor layouts
    def _qkv_sizes(self):
        hf = self.hf_config
        groups, heads, d = hf.num_key_value_heads, hf.num_attention_heads, hf.head_dim
        return groups, heads // groups, d

    def _tp_parts(self, name: str) -> list[int] | None:
        """Global sizes of the parts of in_proj ([q, k, v, z, beta, alpha]) or conv1d ([q, k, v])."""
        hf = self.hf_config
        qk, v = hf.linear_key_head_dim * hf.linear_num_key_heads, hf.linear_value_head_dim * hf.linear_num_value_heads
        if name.endswith("self_attention.in_proj.weight"):
            return [qk, qk, v, v, hf.linear_num_value_heads, hf.linear_num_value_heads]
        if name.endswith("self_attention.conv1d.weight"):
            return [qk, qk, v]
        return None

    def _weight_to_mcore_format(self, name, hf_weights):
        if name.endswith("self_attention.in_proj.weight"):
            return torch.cat([w.to(self.dtype) for w in hf_weights])
        if name.endswith("self_attention.linear_qkv.weight"):
            q_gate, k, v = (w.to(self.dtype) for w in hf_weights)
            groups, per_group, d = self._qkv_sizes()
            hidden = q_gate.shape[-1]
            q_gate = q_gate.view(groups, per_group, 2, d, hidden)
            q, gate = q_gate[:, :, 0].reshape(groups, -1, hidden), q_gate[:, :, 1].reshape(groups, -1, hidden)
            return torch.cat([q, gate, k.view(groups, d, hidden), v.view(groups, d, hidden)], 1).reshape(-1, hidden)
        return super()._weight_to_mcore_format(name, hf_weights)

    def _weight_to_hf_format(self, name, weight):
        hf_names = self._weight_name_mapping_mcore_to_hf(name)
        if name.endswith("self_attention.in_proj.weight"):
            qk, _, v, _, heads, _ = self._tp_parts(name)
            return hf_names, list(weight.split([2 * qk + v, v, heads, heads]))
        if name.endswith("self_attention.linear_qkv.weight"):
            groups, per_group, d = self._qkv_sizes()
            hidden = weight.shape[-1]
            w = weight.view(groups, 2 * per_group + 2, d, hidden)
            q, gate = w[:, :per_group], w[:, per_group:2 * per_group]
            q_gate = torch.stack([q, gate], 2).reshape(-1, hidden)
            return hf_names, [q_gate, w[:, -2].reshape(-1, hidden), w[:, -1].reshape(-1, hidden)]
        return super()._weight_to_hf_format(name, weight)
